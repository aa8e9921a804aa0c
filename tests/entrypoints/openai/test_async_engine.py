"""AsyncLLMEngine in process: streaming, rejection, abort on early exit, shutdown."""
from __future__ import annotations

import asyncio

import pytest

from pressroom import EngineArgs, SamplingParams
from pressroom.engine.async_engine import AsyncLLMEngine, EngineDeadError


@pytest.fixture(scope="module")
def engine(tiny_async_engine):
    return tiny_async_engine  # the tiny llama (shared: conftest.py)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_streams_cumulative_outputs_concurrently(engine):
    async def one(rid: str, prompt: str) -> list:
        return [out async for out in engine.generate(rid, prompt, _greedy(6))]

    async def main():
        return await asyncio.gather(one("a", "Hello"), one("b", "Good morning"))

    for outs in asyncio.run(main()):
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)


def test_rejection_reaches_the_caller_only(engine):
    async def main():
        good = engine.generate("good", "Hello", _greedy(300))  # long enough to be in flight below
        first = await good.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            async for _ in engine.generate("good", "Hello", _greedy(5)):
                pass
        with pytest.raises(ValueError):
            async for _ in engine.generate("bad", [10 ** 9], _greedy(5)):
                pass
        rest = [out async for out in good]
        return first, rest

    first, rest = asyncio.run(main())
    assert rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 300


def test_leaving_early_aborts_and_frees_blocks(engine):
    async def main():
        async for _ in engine.generate("early", "Hello", _greedy(1000)):
            break  # aclose via the async-generator finalizer, or explicitly below

        stream = await engine.add_request("early2", "Hello", _greedy(1000))
        await stream.__anext__()
        await stream.aclose()
        task = asyncio.create_task(_drain(engine.generate("cancelled", "Hello", _greedy(1000))))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            stats = await engine.stats()
            if stats.num_running == stats.num_waiting == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = asyncio.run(main())
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    assert not engine.engine.has_unfinished_requests()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_shutdown_ends_streams_and_refuses_new_requests(tiny_model_dir):
    args = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.05)
    eng = AsyncLLMEngine.from_engine_args(args)

    async def main():
        stream = await eng.add_request("x", "Hello", _greedy(1000))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            await _drain(stream)
        with pytest.raises(EngineDeadError):
            await eng.add_request("y", "Hello", _greedy(3))

    asyncio.run(main())
    assert not eng.is_running


def test_build_error_reaches_the_caller():
    with pytest.raises(ValueError, match="does not exist|not found|No such"):
        AsyncLLMEngine.from_engine_args(EngineArgs(model="/nonexistent/model/dir"))
