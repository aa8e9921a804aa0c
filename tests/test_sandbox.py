"""The sandboxed worker pool (pressroom/sandbox.py) with a stdlib worker script: a job past its deadline, one whose
worker dies, one past the memory cap and one that retires its worker each cost that worker alone, a
replacement serves the next job, and a pool whose workers are all busy says so."""
from __future__ import annotations

import asyncio
import time

import pytest

from pressroom.sandbox import PoolBusy, WorkerFailed, WorkerPool, WorkerTimeout, job_line

SCRIPT = '''
import json, os, sys, time
out = sys.stdout.buffer
out.write(b'{"ready": true}\\n'); out.flush()
for line in sys.stdin.buffer:
    job = json.loads(line)
    if job["do"] == "sleep":
        time.sleep(job["s"])
    elif job["do"] == "exit":
        os._exit(3)
    reply = {"pid": os.getpid(), "retire": job["do"] == "retire"}
    if job["do"] == "allocate":
        try:
            reply["bytes"] = len(bytearray(job["bytes"]))
        except MemoryError:
            reply["error"] = "memory"
    out.write(json.dumps(reply).encode() + b"\\n"); out.flush()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(SCRIPT)
    return path


def _job(do: str, **fields) -> bytes:
    return job_line({"do": do, **fields})


def test_a_job_that_costs_its_worker_is_refused_and_a_replacement_serves_the_next(script):
    async def main():
        pool = WorkerPool(script, size=1, timeout_s=1.0, max_bytes=64 << 20)
        try:
            first = (await pool.ask(_job("echo")))["pid"]
            with pytest.raises(WorkerTimeout):
                await pool.ask(_job("sleep", s=30))
            second = (await pool.ask(_job("echo")))["pid"]
            with pytest.raises(WorkerFailed):
                await pool.ask(_job("exit"))
            third = (await pool.ask(_job("echo")))["pid"]
            assert (await pool.ask(_job("retire")))["retire"]
            fourth = (await pool.ask(_job("echo")))["pid"]
            assert len({first, second, third, fourth}) == 4  # each refusal replaced its worker
        finally:
            await pool.close()
    asyncio.run(main())


def test_the_memory_cap_is_the_jobs_beyond_the_workers_start(script):
    async def main():
        pool = WorkerPool(script, size=1, timeout_s=5.0, max_bytes=64 << 20)
        try:
            assert (await pool.ask(_job("allocate", bytes=16 << 20)))["bytes"] == 16 << 20
            assert (await pool.ask(_job("allocate", bytes=256 << 20)))["error"] == "memory"
        finally:
            await pool.close()
    asyncio.run(main())


def test_every_worker_busy_is_pool_busy(script):
    async def main():
        pool = WorkerPool(script, size=1, timeout_s=5.0, max_bytes=64 << 20, wait_s=0.2)
        try:
            await pool.start()
            slow = asyncio.ensure_future(pool.ask(_job("sleep", s=1)))
            await asyncio.sleep(0.05)
            start = time.perf_counter()
            with pytest.raises(PoolBusy):
                await pool.ask(_job("echo"))
            assert time.perf_counter() - start < 1.0
            assert "pid" in await slow
        finally:
            await pool.close()
    asyncio.run(main())
