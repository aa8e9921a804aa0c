"""/v1/completions: one or more prompts (text or token ids) x n, whole or streamed, with logprobs and echo."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pressroom.engine import beam_search
from pressroom.engine.async_engine import EngineDeadError
from pressroom.entrypoints.openai.errors import APIError
from pressroom.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pressroom.entrypoints.openai.serving import (
    ABORT,
    OpenAIServing,
    Routing,
    access_record,
    finite_logprob,
    json_response,
    output_values,
    prompt_logprobs_of,
    request_routing,
    running_usage,
    sse_data,
    stream_usage,
    with_own_token,
)
from pressroom.entrypoints.openai.streams import collect_finals, merge_streams, raise_if_failed, with_disconnect
from pressroom.lora.request import LoRARequest
from pressroom.outputs import PositionLogprobs, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        lora = self._check_model(req.model)
        self._check_combination(req)
        if req.use_beam_search and req.stream:  # its beams are known only once the search ends (vLLM's 400 too)
            raise APIError(400, "Streaming is not currently supported with beam search: leave out `stream`, or "
                                "sample the n choices instead of searching.", param="use_beam_search")
        if req.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        best_of = _best_of(req)
        routing = request_routing(request, req)
        try:
            given = _prompt_list(req.prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        prompts = await self._completion_prompts(req, given)
        params = [self._sampling_params(req, req.max_tokens, ids, "prompt") for _, ids in prompts]
        if best_of > req.n:  # best_of samples, each scored by its cumulative logprob (the sampled tokens' own)
            params = [sp.clone(n=best_of, logprobs=0 if sp.logprobs is None else sp.logprobs) for sp in params]
        self._admit(req.tokens_cost([len(ids) for _, ids in prompts], self.engine.max_model_len))
        rid = random_id("cmpl")
        if req.use_beam_search:
            return await self._beam_search(request, req, rid, prompts, routing, lora)
        streams = await self._add_all(request, rid, [(req.prompt_dict(ids, text), sp)
                                                     for (text, ids), sp in zip(prompts, params)], routing, lora)
        model = req.model or self.names[0]
        if req.stream:
            return self._sse(self._completion_chunks(rid, model, req, streams))
        finals = await with_disconnect(request, collect_finals(streams))
        usage = self._usage(finals)  # every sample best_of made, as OpenAI counts them
        if best_of > req.n:
            finals = [_best_samples(out, req.n, keep_logprobs=req.logprobs is not None) for out in finals]

        def response() -> CompletionResponse:
            choices = [choice for i, out in enumerate(finals)
                       for choice in self._completion_choices(out, req, i * req.n)]
            return CompletionResponse(id=rid, model=model, choices=choices, usage=usage,
                                      system_fingerprint=self.system_fingerprint,
                                      kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)
        return await json_response(response, "choices", output_values(finals, req.logprobs))

    async def _beam_search(self, request: Request, req: CompletionRequest, rid: str,
                           prompts: list[tuple[str | None, list[int]]], routing: Routing,
                           lora: LoRARequest | None) -> Response:
        """use_beam_search (vLLM's): each prompt's n best beams, best first (never streamed: refused before)."""
        finals = await self._searched(request, req, rid, prompts, routing, lora)
        usage = self._usage(finals)
        record = access_record(request)
        record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        response = CompletionResponse(id=rid, model=req.model or self.names[0], usage=usage,
                                      system_fingerprint=self.system_fingerprint,
                                      choices=[choice for i, out in enumerate(finals)
                                               for choice in self._completion_choices(out, req, i * req.n)])
        return await json_response(lambda: response, "choices", output_values(finals, req.logprobs))

    async def _searched(self, request: Request, req: CompletionRequest, rid: str,
                        prompts: list[tuple[str | None, list[int]]], routing: Routing,
                        lora: LoRARequest | None) -> list[RequestOutput]:
        """Each prompt's best beams as one finished output, the live beams of all prompts run as one batch a step."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "Beam search needs a tokenizer; this server runs with skip_tokenizer_init.",
                           param="use_beam_search")
        try:
            params = self.sampling_defaults.fill(req).to_beam_search_params(req.max_tokens)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        searches = [beam_search.BeamSearch(ids, params, self.engine.engine.eos_token_id, self.engine.max_model_len)
                    for _, ids in prompts]
        step_params, steps = beam_search.step_params(params), itertools.count()

        async def step(beams: beam_search.Beams) -> list:
            streams = await self._add_all(request, f"{rid}-step{next(steps)}",
                                          [(req.prompt_dict(ids), step_params) for _, ids in beams], routing, lora)
            return [beam_search.candidates_of(out) for out in await collect_finals(streams)]
        await with_disconnect(request, beam_search.run_async(searches, step))

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
        finals = [search.request_output(rid, text, decode) for search, (text, _) in zip(searches, prompts)]
        for out in finals:
            out.prompt_logprobs = [None] * len(out.prompt_token_ids)  # what echo shows of the prompt: no logprobs
        return finals

    async def _completion_prompts(self, req: CompletionRequest, given: list[str | list[int]]
                                  ) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt, truncated as truncate_prompt_tokens asks (a text's own text is
        dropped where its tokens were: echo then shows what the model read)."""
        if req.truncate_prompt_tokens is None:
            return await self._prompt_ids(given, "prompt")
        engine = self.engine
        # tokenized whole, as the kept tail is what counts against the context
        whole = await self._run(lambda: [engine.tokenize_prompt(p) for p in given],
                                sum(len(p) for p in given if isinstance(p, str)))
        try:
            kept = [req.truncated(ids, engine.max_model_len) for _, ids in whole]
        except ValueError as e:
            raise APIError(400, str(e), param="truncate_prompt_tokens") from None
        return [(text if len(ids) == len(k) else None, k) for (text, ids), k in zip(whole, kept)]

    def _completion_choices(self, out: RequestOutput, req: CompletionRequest, base: int) -> list[CompletionChoice]:
        prefix = self._echoed_prompt(out) if req.echo else ""
        # beam search reads no prompt_logprobs (its prompt's positions are blank for echo's sake)
        prompt_logprobs = None if req.use_beam_search else prompt_logprobs_of(out)
        choices = []
        for c in out.outputs:
            logprobs = None
            shown = [] if req.echo_only else list(c.token_ids)  # echo_only: the prompt alone
            if req.logprobs is not None:
                tokens, positions = self._echoed_positions(out, shown, list(c.logprobs or [])[:len(shown)], req)
                logprobs = self._completion_logprobs(tokens, positions, req.logprobs, as_id=self._as_ids(req))
            text = prefix if req.echo_only else prefix + c.text
            choices.append(CompletionChoice(index=base + c.index, text=text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=prompt_logprobs,
                                            **_token_ids(req, out.prompt_token_ids, list(c.token_ids))))
        return choices

    @staticmethod
    def _echoed_positions(out: RequestOutput, tokens: list[int], positions: list[PositionLogprobs | None],
                          req: CompletionRequest) -> tuple[list[int], list[PositionLogprobs | None]]:
        """The tokens whose logprobs a choice shows and their positions: with echo, the prompt's come first (its
        first position has none)."""
        if not req.echo:
            return tokens, positions
        prompt = list(out.prompt_logprobs or [])
        prompt += [None] * (len(out.prompt_token_ids) - len(prompt))
        return list(out.prompt_token_ids) + tokens, prompt + positions

    def _completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None], top: int,
                             offset: int = 0, as_id: bool = False) -> CompletionLogprobs:
        """OpenAI's completion logprobs; each position's `top_logprobs` holds its own token (sampled, or the
        prompt's with echo) beside the top `top`, as vLLM's do."""
        lp = CompletionLogprobs()
        for token, position in zip(token_ids, positions):
            text = self._token_text(token, position, as_id)
            lp.tokens.append(text)
            lp.text_offset.append(offset)
            offset += len(text)
            if position is None:
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(finite_logprob(position[token].logprob) if token in position else None)
            lp.top_logprobs.append({self._token_text(t, position, as_id): finite_logprob(p.logprob)
                                    for t, p in with_own_token(position, token, top)})
        return lp

    async def _completion_chunks(self, rid: str, model: str, req: CompletionRequest,
                                 streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        created = int(time.time())
        total = len(streams) * req.n
        sent_text, sent_lp, sent_ids, done = [0] * total, [0] * total, [0] * total, [False] * total
        echoed = [not req.echo] * total
        offsets = [0] * total  # characters sent of each choice, echo's included: its logprobs' text_offset
        finals: dict[int, RequestOutput] = {}
        usage_at_end, usage_each = stream_usage(req, self.force_include_usage)
        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    k = i * req.n + c.index
                    if done[k]:
                        continue
                    delta = "" if req.echo_only else c.text[sent_text[k]:]  # echo_only: the prompt alone
                    if not echoed[k]:
                        delta = self._echoed_prompt(out) + delta
                    logprobs = None
                    if req.logprobs is not None and c.logprobs is not None:
                        tokens, positions = c.token_ids[sent_lp[k]:], c.logprobs[sent_lp[k]:]
                        if req.echo_only:
                            tokens, positions = [], []
                        if not echoed[k]:  # echo's first chunk: the prompt's logprobs before the first token's
                            tokens, positions = self._echoed_positions(out, list(tokens), list(positions), req)
                        logprobs = self._completion_logprobs(tokens, positions, req.logprobs, offsets[k],
                                                             self._as_ids(req))
                        sent_lp[k] = len(c.token_ids)
                    if not delta and c.finish_reason is None and not (logprobs and logprobs.tokens):
                        continue
                    # the prompt's ids go in the choice's first chunk (no chunk is sent before its first token)
                    ids = _token_ids(req, None if sent_ids[k] else out.prompt_token_ids, c.token_ids[sent_ids[k]:])
                    sent_text[k], done[k], echoed[k] = len(c.text), c.finish_reason is not None, True
                    sent_ids[k] = len(c.token_ids)
                    offsets[k] += len(delta)
                    choice = CompletionChoice(index=k, text=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                                              stop_reason=c.stop_reason, **ids)
                    chunk = CompletionResponse(id=rid, created=created, model=model, choices=[choice])
                    if usage_each:  # continuous_usage_stats: this prompt's tokens and this choice's so far
                        chunk.usage = running_usage(len(out.prompt_token_ids), len(c.token_ids))
                    if done[k] and not usage_at_end:  # the last word of this choice (a usage chunk would be)
                        chunk.system_fingerprint = self.system_fingerprint
                    yield sse_data(chunk)
                if out.finished:
                    finals[i] = out
        except EngineDeadError:  # the engine ended the request (shutdown's grace period over, or the core died)
            for k in range(total):  # each open choice gets its finish reason; the error event follows (_sse)
                if not done[k]:
                    choice = CompletionChoice(index=k, text="", finish_reason=ABORT)
                    yield sse_data(CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
            raise
        raise_if_failed(finals.values())  # a choice ended with "error": the error event follows (_sse)
        if usage_at_end and len(finals) == len(streams):
            usage = self._usage([finals[i] for i in sorted(finals)])
            yield sse_data(CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage,
                                              system_fingerprint=self.system_fingerprint))

    def _echoed_prompt(self, out: RequestOutput) -> str:
        """The prompt as text, for `echo` (a prompt given as token ids has no text of its own)."""
        return out.prompt or self.engine.tokenizer.decode(out.prompt_token_ids)


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValueError("The prompt is empty.")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _token_ids(req: CompletionRequest, prompt_ids: list[int] | None, ids: list[int]) -> dict[str, list[int] | None]:
    """A choice's `prompt_token_ids` and `token_ids` where return_token_ids asks for them (vLLM's)."""
    if not req.return_token_ids:
        return {}
    return {"prompt_token_ids": None if prompt_ids is None else list(prompt_ids), "token_ids": list(ids)}


def _best_of(req: CompletionRequest) -> int:
    """best_of (OpenAI's): how many samples a prompt makes, of which the n with the highest cumulative logprob come
    back. Not streamed (the best are known only at the end) and never fewer than n."""
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if req.best_of < req.n:
        raise APIError(400, f"best_of ({req.best_of}) must be at least n ({req.n}).", param="best_of")
    if req.use_beam_search:
        raise APIError(400, "best_of does not apply to beam search (its n beams are the best ones): leave it out.",
                       param="best_of")
    if req.stream:
        raise APIError(400, "best_of above n cannot be streamed: the best samples are known only once all end; "
                            "leave out `stream` or best_of.", param="best_of")
    return req.best_of


def _best_samples(out: RequestOutput, n: int, keep_logprobs: bool) -> RequestOutput:
    """The n samples of `out` with the highest cumulative logprob, best first and numbered 0..n-1; their per-token
    logprobs dropped where the request asked for none (they were taken only to score the samples)."""
    best = sorted(out.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:n]
    kept = [dataclasses.replace(c, index=i, **({} if keep_logprobs else {"logprobs": None, "cumulative_logprob": None}))
            for i, c in enumerate(best)]
    return dataclasses.replace(out, outputs=kept)
