"""A script that builds `LLM(..., tensor_parallel_size=2)` at module level, with no `if __name__ == "__main__":`
guard, runs as it does in vLLM: the workers are forked where that is safe (VLLM_WORKER_MULTIPROC_METHOD=fork,
vLLM's default) and otherwise start in fresh interpreters that never import the script (multiprocessing's spawn
re-imported it and failed: "An attempt has been made to start a new process before the current process has
finished its bootstrapping phase")."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from pressroom import LLM, SamplingParams
from pressroom.executor.process import WORKER_METHOD_ENV, fork_hazard, worker_start_method

PROMPT = [1, 2, 3, 4, 5]
MAX_TOKENS = 6

SCRIPT = """\
from pressroom import LLM, SamplingParams

llm = LLM({model!r}, dtype="float32", device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True, detokenize=False)
out = llm.generate([{{"prompt_token_ids": {prompt!r}}}], params, use_tqdm=False)
print("TOKENS", list(out[0].outputs[0].token_ids))
"""


def _run_unguarded(tmp_path, model: str, **env: str) -> tuple[list[int], str]:
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT.format(model=model, max_tokens=MAX_TOKENS, prompt=PROMPT))
    assert "__main__" not in script.read_text()
    run_env = {k: v for k, v in os.environ.items() if k != WORKER_METHOD_ENV} | env
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("TOKENS "))
    return eval(line.removeprefix("TOKENS ")), done.stderr  # noqa: S307 — our own script's list of ints


def _one_rank_tokens(model: str) -> list[int]:
    with LLM(model, dtype="float32", device="cpu", skip_tokenizer_init=True) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_start_method_follows_vllms_variable(monkeypatch):
    monkeypatch.setenv(WORKER_METHOD_ENV, "spawn")
    assert worker_start_method() == "spawn"
    monkeypatch.setenv(WORKER_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=WORKER_METHOD_ENV):
        worker_start_method()
    # fork asked (and vLLM's default), but this process runs other threads: never forked
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert "threads" in (fork_hazard() or "")
        monkeypatch.setenv(WORKER_METHOD_ENV, "fork")
        assert worker_start_method() == "spawn"
        monkeypatch.delenv(WORKER_METHOD_ENV)
        assert worker_start_method() == "spawn"
    finally:
        stop.set()
        thread.join()


# The path the script takes (torch's OpenMP threads make a fork unsafe, so fresh interpreters).
@pytest.mark.slow  # two worker processes importing torch afresh: 9 s on two idle cores, 18 s on busy ones
def test_unguarded_module_level_script_runs_two_ranks(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    tokens, log = _run_unguarded(tmp_path, model)
    assert "bootstrapping phase" not in log
    assert "worker processes started (fresh interpreters)" in log
    assert tokens == _one_rank_tokens(model)


@pytest.mark.slow  # two more two-rank runs in subprocesses (some 6 and 9 s on two idle cores, 30 s on busy ones)
def test_unguarded_script_forked_where_safe_and_spawned_when_asked(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama")
    # one OpenMP thread: the parent stays single-threaded until its workers start, so vLLM's default forks
    forked, log = _run_unguarded(tmp_path, model, OMP_NUM_THREADS="1")
    assert "worker processes started (forked)" in log
    spawned, log = _run_unguarded(tmp_path, model, OMP_NUM_THREADS="1", **{WORKER_METHOD_ENV: "spawn"})
    assert "worker processes started (fresh interpreters)" in log
    assert forked == spawned == _one_rank_tokens(model)
