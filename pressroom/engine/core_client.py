"""The engine core in a process of its own, and the client the API process reaches it through.

As in vLLM v1, the API process keeps HTTP, tokenization and detokenization, and the core process runs
the scheduler and the model in a busy loop, so neither waits on the other's GIL. They talk over two
ZMQ sockets (ipc): the client PUSHes requests and finishes, the core PUSHes each step's outputs (and,
when idle, a heartbeat with its stats once a second). Messages are msgspec msgpack, kind and payload
in two frames.

The core dies with its parent (PR_SET_PDEATHSIG, and a parent-pid check in the loop): SIGTERM, which it
handles by leaving in order, so that the temporary folders (its sockets', its workers') go with it even
when the parent was SIGKILLed; SIGALRM ends it if leaving hangs. When it fails it says why before it
exits, and the client reports a death it was not told of within half a second.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from concurrent.futures import Future
from functools import partial

import msgspec
import zmq

from pressroom.config import EngineConfig
from pressroom.core.request import RequestStatus
from pressroom.engine.core import CoreInfo, CoreOutputs, CoreRequest, EngineCore, check_sleep_args
from pressroom.executor import FATAL_ERRORS
from pressroom.executor.process import allow_children, die_with_parent

logger = logging.getLogger("pressroom")

_ADD, _FINISH, _SHUTDOWN, _EOS = b"add", b"finish", b"shutdown", b"eos"
_RESET_PREFIX_CACHE = b"reset-prefix-cache"
_SLEEP, _WAKE_UP = b"sleep", b"wake-up"  # sleep mode; the core answers each with a CoreOutputs' reply
_READY, _OUTPUTS, _FAILED = b"ready", b"out", b"failed"
HEARTBEAT_SECONDS = 1.0
EXIT_GRACE_SECONDS = 10  # the core's own shutdown, at most, as the client's `shutdown` waits for it
_POLL_MS = 500


class EngineDeadError(RuntimeError):
    """The engine core failed or was shut down; no request can be served."""


class CoreClient:
    """Starts the core process and speaks for it: `add_request` and `finish_requests` as EngineCore has
    them, and `recv` for its outputs. Not thread-safe: the caller serialises its calls."""

    EOS_FUTURE = True  # `eos_token_id` may be a Future (LLMEngine loads its tokenizer while the core starts)

    def __init__(self, config: EngineConfig, eos_token_id: int | None | Future, start_timeout: float = 600.0,
                 wait: bool = True) -> None:
        """`wait` False: returns once the process is started; `wait_ready` then waits for it (several cores
        start side by side). `eos_token_id` a Future: the process starts at once (its imports, seconds, overlap
        whatever the caller is still loading) and is sent the id once the Future has it; a Future that fails
        kills the process and `wait_ready` raises its error."""
        self._dir = tempfile.mkdtemp(prefix="pressroom-core-")
        # Removed by `shutdown`, at the interpreter's exit otherwise, and by the core if this process dies
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        in_addr, out_addr = _addresses(self._dir)
        self._zmq = zmq.Context()
        self._input = self._zmq.socket(zmq.PUSH)
        self._input.bind(in_addr)
        self._output = self._zmq.socket(zmq.PULL)
        self._output.bind(out_addr)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs = msgspec.msgpack.Decoder(CoreOutputs)
        spawn = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        self._eos = eos_token_id if isinstance(eos_token_id, Future) else None
        args = (config, None if self._eos else eos_token_id, self._dir, os.getpid(), self._eos is not None)
        self.process = spawn.Process(target=run_engine_core, args=args, name="pressroom-engine-core", daemon=True)
        self.process.start()
        self.info: CoreInfo | None = None
        if wait:
            self.wait_ready(start_timeout)

    @property
    def output_socket(self) -> zmq.Socket:
        """Where the core's messages arrive (for a poller over several cores)."""
        return self._output

    def wait_ready(self, timeout: float = 600.0) -> None:
        try:
            self.info = self._wait_ready(timeout)
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float) -> CoreInfo:
        deadline = time.monotonic() + timeout
        if self._eos is not None:
            try:
                eos = self._eos.result(timeout)
            except BaseException:
                self.process.kill()  # it has only imported: nothing to shut down gracefully
                raise
            self._eos = None
            self._input.send_multipart([_EOS, self._encoder.encode(eos)])
        while time.monotonic() < deadline:
            if self._output.poll(_POLL_MS):
                kind, payload = self._output.recv_multipart()
                if kind == _READY:
                    return msgspec.msgpack.decode(payload, type=CoreInfo)
                if kind == _FAILED:
                    raise _startup_error(msgspec.msgpack.decode(payload, type=str))
            elif not self.process.is_alive():
                code = self.process.exitcode
                raise RuntimeError(f"The engine core process exited while starting (exit code {code}).")
        raise RuntimeError(f"The engine core did not start within {timeout:.0f} s.")

    def add_request(self, request: CoreRequest) -> None:
        self._input.send_multipart([_ADD, self._encoder.encode(request)])

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        self._input.send_multipart([_FINISH, self._encoder.encode((req_ids, status.name))])

    def reset_prefix_cache(self) -> None:
        """The core forgets every cached prefix before it reads any request sent after this (one socket keeps the
        order). Running requests keep their blocks; only the hash index is emptied, as a failed step empties it."""
        self._input.send_multipart([_RESET_PREFIX_CACHE, b""])

    def sleep(self, level: int, mode: str) -> None:
        """EngineCore.sleep in the core; it answers with a message whose `reply` is set (mode "wait": once the
        requests in flight are done)."""
        self._input.send_multipart([_SLEEP, self._encoder.encode((level, mode))])

    def wake_up(self, tags: list[str] | None) -> None:
        """EngineCore.wake_up in the core; it answers with a message whose `reply` is set."""
        self._input.send_multipart([_WAKE_UP, self._encoder.encode(tags)])

    def recv(self, timeout_ms: int = _POLL_MS) -> CoreOutputs | None:
        """The core's next message, or None after `timeout_ms` of silence; EngineDeadError once it is gone."""
        if not self._output.poll(timeout_ms):
            if not self.process.is_alive():
                raise EngineDeadError(f"The engine core process died (exit code {self.process.exitcode}).")
            return None
        kind, payload = self._output.recv_multipart()
        if kind == _FAILED:
            raise EngineDeadError(f"The engine core failed: {msgspec.msgpack.decode(payload, type=str)}")
        return self._outputs.decode(payload)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the core to stop, then makes sure: it is killed if it has not exited within `timeout`."""
        if self.process.is_alive():
            try:
                self._input.send_multipart([_SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._zmq.term()
        self._remove_dir()


def _addresses(socket_dir: str) -> tuple[str, str]:
    """Where the client's input and output sockets are bound: ipc files in the client's temporary folder."""
    return f"ipc://{socket_dir}/in", f"ipc://{socket_dir}/out"


def _startup_error(message: str) -> Exception:
    # A configuration the engine rejects stays a ValueError for the caller, as it is in-process.
    kind, _, text = message.partition(": ")
    return ValueError(text) if kind == "ValueError" else RuntimeError(f"The engine core failed to start: {message}")


# ---- the core process ----

class _Terminated(BaseException):
    """SIGTERM reached the core: its parent died (PR_SET_PDEATHSIG) or someone asked it to end. A
    BaseException, so that no step's fault handling takes it for a request's fault."""


def _on_sigterm(signum: int, frame) -> None:
    raise _Terminated


def run_engine_core(config: EngineConfig, eos_token_id: int | None, socket_dir: str, parent_pid: int,
                    eos_to_come: bool = False) -> None:
    """`socket_dir`: the client's temporary folder, with its sockets; removed here as the core leaves.
    `eos_to_come`: the end-of-sequence id is the first message (CoreClient given a Future); a shutdown
    instead ends the process before it builds anything."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    die_with_parent(signal.SIGTERM)
    allow_children()  # the multiprocess executor's workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent shuts us down
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    in_addr, out_addr = _addresses(socket_dir)
    inp.connect(in_addr)
    out.connect(out_addr)
    encoder = msgspec.msgpack.Encoder()
    core, asked_to_stop, terminated = None, False, False
    try:
        if os.getppid() != parent_pid:  # it died before PR_SET_PDEATHSIG was set: no signal will come
            raise _Terminated
        if eos_to_come:
            kind, payload = inp.recv_multipart()
            if kind != _EOS:  # a shutdown: the front-end failed to start
                asked_to_stop = True
                return
            eos_token_id = msgspec.msgpack.decode(payload, type=int | None)
        core = EngineCore(config, eos_token_id)
        out.send_multipart([_READY, encoder.encode(core.info)])
        _busy_loop(core, inp, out, encoder, parent_pid)
        asked_to_stop = True
    except _Terminated:
        asked_to_stop = terminated = True
    except BaseException as e:  # noqa: BLE001 — the client must hear why, whatever it was
        logger.exception("engine core failed")
        out.send_multipart([_FAILED, encoder.encode(f"{type(e).__name__}: {e}")])
    finally:
        _leave(core, ctx, inp, out, socket_dir, client_gone=terminated or os.getppid() != parent_pid)
        if asked_to_stop:
            _exit_now()


def _leave(core: EngineCore | None, ctx: zmq.Context, inp, out, socket_dir: str, client_gone: bool) -> None:
    """The core's shutdown (which removes the workers' folder), bounded: a SIGTERM now is ignored (it is
    under way) and SIGALRM ends the process after EXIT_GRACE_SECONDS. Then the client's folder goes too (if
    the client lives, its bound sockets need it no more). `client_gone`: its process is gone or going (a
    SIGTERM: a SIGKILLed process's threads end one by one, and the first to go, if it started us, sends
    PR_SET_PDEATHSIG's signal while the process still lives), so its folder goes first, and no last
    message waits for a reader."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.alarm(EXIT_GRACE_SECONDS)
    if client_gone:
        shutil.rmtree(socket_dir, ignore_errors=True)
    if core is not None:
        core.shutdown()
    inp.close(linger=0)
    out.close(linger=0 if client_gone else 2000)  # let a last message leave
    ctx.term()
    shutil.rmtree(socket_dir, ignore_errors=True)


def _exit_now() -> None:
    """Ends the core process once it has shut down cleanly, without the interpreter's own teardown: freeing
    torch's, transformers' and the model's modules object by object took a second or more of every server's
    stop (on 2 cores), and there is nothing left for it to do."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _busy_loop(core: EngineCore, inp, out, encoder, parent_pid: int) -> None:
    requests = msgspec.msgpack.Decoder(CoreRequest)
    finishes = msgspec.msgpack.Decoder(tuple[list[str], str])
    sleeps = msgspec.msgpack.Decoder(tuple[int, str])
    wakes = msgspec.msgpack.Decoder(list[str] | None)
    waiting_sleep: tuple[int, str] | None = None  # a "wait" sleep, until the requests in flight are done
    held: list[CoreRequest] = []  # requests sent during that drain: added once asleep, to wait for wake_up (vLLM's)
    last_sent = time.monotonic()
    while True:
        busy = _runnable(core)
        if inp.poll(0 if busy else int(HEARTBEAT_SECONDS * 1000)):
            busy = True  # after messages, report at once (an abort's freed blocks show in the stats)
            while True:
                try:
                    kind, payload = inp.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if kind == _SHUTDOWN:
                    return
                if kind == _ADD:
                    request = requests.decode(payload)
                    if waiting_sleep is not None:
                        held.append(request)
                    else:
                        _add(core, out, encoder, request)
                elif kind == _FINISH:
                    ids, status = finishes.decode(payload)
                    core.finish_requests(ids, RequestStatus[status])
                    held = [r for r in held if r.req_id not in ids]
                elif kind == _RESET_PREFIX_CACHE:
                    core.kv_cache.reset_prefix_cache()
                elif kind == _SLEEP:
                    level, mode = sleeps.decode(payload)
                    if mode == "wait" and core.has_unfinished_requests():  # answered once they are done
                        enabled = core.config.model.enable_sleep_mode
                        if _answer(out, encoder, core, partial(check_sleep_args, enabled, level, mode)) is None:
                            waiting_sleep = (level, mode)
                    else:
                        _answer(out, encoder, core, partial(core.sleep, level, mode), send=True)
                elif kind == _WAKE_UP:
                    tags = wakes.decode(payload)
                    _answer(out, encoder, core, partial(core.wake_up, tags), send=True)
        if waiting_sleep is not None and not core.has_unfinished_requests():
            level, mode = waiting_sleep
            waiting_sleep = None
            _answer(out, encoder, core, partial(core.sleep, level, mode), send=True)
            for request in held:
                _add(core, out, encoder, request)
            held = []
        if _runnable(core):
            step = core.step()
            step.stats = core.stats()
            out.send_multipart([_OUTPUTS, encoder.encode(step)])
            last_sent = time.monotonic()
        elif busy or time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
            out.send_multipart([_OUTPUTS, encoder.encode(CoreOutputs([], [], core.stats()))])
            last_sent = time.monotonic()
        if os.getppid() != parent_pid:
            return


def _add(core: EngineCore, out, encoder, request: CoreRequest) -> None:
    rejected = core.try_add_request(request)
    if rejected is not None:
        out.send_multipart([_OUTPUTS, encoder.encode(CoreOutputs([rejected], []))])


def _runnable(core: EngineCore) -> bool:
    """Work to step: requests, and the core awake (asleep, requests added wait for wake_up)."""
    return core.has_unfinished_requests() and not core.is_sleeping()


def _answer(out, encoder, core: EngineCore, call, send: bool = False) -> str | None:
    """Runs a sleep-mode call; its error (a refusal: a bad level, sleep mode off) is answered at once, and so is
    its success with `send`, with the outputs it returns (requests it ended). None: it succeeded."""
    try:
        ended = call() or []
    except FATAL_ERRORS:  # a worker died: the engine ends, as after a step
        raise
    except Exception as e:  # noqa: BLE001 — the caller hears why; the core goes on
        logger.warning("sleep mode: %s", e)
        reply = f"{type(e).__name__}: {e}"
        out.send_multipart([_OUTPUTS, encoder.encode(CoreOutputs([], [], core.stats(), reply=reply))])
        return str(e)
    if send:
        out.send_multipart([_OUTPUTS, encoder.encode(CoreOutputs(ended, [], core.stats(), reply=""))])
    return None
