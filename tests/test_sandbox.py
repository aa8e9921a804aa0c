"""The sandboxed worker pool (pressroom/sandbox.py) with a stdlib worker script: a job past its deadline, one whose
worker dies, one past the memory cap and one that retires its worker each cost that worker alone, a
replacement serves the next job, a pool whose workers are all busy says so, and the workers die with the server."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

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


SERVER = '''
import asyncio, sys
from pressroom.sandbox import WorkerPool, job_line

async def main():
    pool = WorkerPool(sys.argv[1], size=2, timeout_s=60.0, max_bytes=64 << 20)
    await pool.start()
    busy = asyncio.ensure_future(pool.ask(job_line({"do": "sleep", "s": 60})))  # a job in progress
    await asyncio.sleep(0.2)
    print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)
    await busy

asyncio.run(main())
'''


def test_the_workers_die_with_the_server_even_mid_job(script, tmp_path):
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in server.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
