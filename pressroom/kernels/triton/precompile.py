"""Compiles pressroom's Triton kernels in parallel processes at start, from a manifest earlier starts recorded.

A cold start spends most of its time in Triton compiling kernels one after another in the worker process (33 s of
V2-Lite's start on an H100; threads do not help, the compiler holds the GIL). Every start records the kernels its
JIT compiles (Triton's `jit_post_compile_hook` gives each one's specialization as JSON) into a manifest kept per
model, dtype, quantization, tensor-parallel size, GPU and Triton version; the next start hands the manifest to a
pool of processes that compile each kernel for the recorded GPU target without a CUDA context, into Triton's
on-disk cache under the key the JIT computes for it (the same source, signature, constexprs, attributes,
options, target and environment), so the JIT's first launch of a kernel only loads its binary.

The start does not wait for the pool: while it runs, Triton's cache lookups go through a cache manager that, on a
miss for a kernel the pool has not done yet, takes it out of the pool's queue (the JIT compiles it now) or waits for
the pool process compiling it; so no kernel is compiled twice and the start waits only for kernels it needs. The
pool takes entries in the order the last start first compiled them: the order this start will need them.

Triton is imported where it is used: the engine's CPU processes import this module without it.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import hashlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pressroom.platforms import user_cache_dir

logger = logging.getLogger("pressroom")

MANIFEST_DIR = "triton-manifests"
MANIFEST_CAP = 4096  # entries one manifest keeps (the newest): bounds a file that every start adds to
MAX_WORKERS = 16
WAIT_SECONDS = 120.0  # the longest `StartupKernels.wait` waits for the whole pool by default
CLAIM_WAIT_SECONDS = 60.0  # the longest the JIT waits for a kernel a pool process is compiling (then compiles it)
_PACKAGE_DIR = str(Path(__file__).resolve().parents[2])  # pressroom/
_OWN_PREFIX = "pressroom."  # the kernels recorded: pressroom's own (others' may carry unserializable constexprs)


@dataclass(frozen=True, slots=True)
class KernelManifest:
    """Kernels starts compiled: each Triton's specialization JSON (`serialize_specialization_data`), the last
    start's in the order it first compiled them, then older starts' it lacks; the GPU target (backend, arch, warp
    size) they were compiled for; Triton's version."""
    target: tuple[str, int, int]
    triton_version: str
    entries: tuple[str, ...]

    def merged(self, older: KernelManifest | None, drop: frozenset[str] = frozenset()) -> KernelManifest:
        """This manifest's entries, then those of `older` it lacks and `drop` does not name, up to MANIFEST_CAP
        (`older` is dropped if it was recorded for another target or Triton)."""
        keep = dict.fromkeys(self.entries)
        if older is not None and (older.target, older.triton_version) == (self.target, self.triton_version):
            keep.update(dict.fromkeys(e for e in older.entries if e not in drop))
        return KernelManifest(self.target, self.triton_version, tuple(list(keep)[:MANIFEST_CAP]))

    def to_json(self) -> str:
        return json.dumps({"target": list(self.target), "triton_version": self.triton_version,
                           "entries": list(self.entries)})

    @staticmethod
    def from_json(text: str) -> KernelManifest:
        obj = json.loads(text)
        backend, arch, warp_size = obj["target"]
        entries = obj["entries"]
        if not all(isinstance(e, str) for e in entries):
            raise ValueError("manifest entries must be strings")
        return KernelManifest((str(backend), int(arch), int(warp_size)), str(obj["triton_version"]), tuple(entries))


def manifest_key(model_identity: str, dtype: str, quantization: str, tensor_parallel_size: int, gpu_name: str,
                 capability: tuple[int, int], triton_version: str) -> str:
    """What a start's kernels depend on: the model (its HF config's JSON: shapes), the dtype, the quantization,
    the tensor-parallel size (shards' shapes), the GPU and Triton's version."""
    parts = [model_identity, dtype, quantization, str(tensor_parallel_size), gpu_name,
             f"{capability[0]}.{capability[1]}", triton_version]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def manifest_path(key: str) -> Path:
    return user_cache_dir(MANIFEST_DIR) / f"{key}.json"


def load_manifest(key: str) -> KernelManifest | None:
    """The manifest saved under `key`; None when there is none, or it cannot be read (warned: a start goes on)."""
    path = manifest_path(key)
    try:
        return KernelManifest.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        logger.warning("ignoring the Triton kernel manifest %s, which cannot be read (%s: %s)", path,
                       type(e).__name__, e)
        return None


def save_manifest(key: str, manifest: KernelManifest, drop: frozenset[str] = frozenset()) -> Path:
    """Writes `manifest` merged with what is saved under `key` already (a union, `manifest`'s entries first; less
    the saved entries `drop` names: those that failed to precompile, unless this start recorded them again),
    atomically."""
    path = manifest_path(key)
    merged = manifest.merged(load_manifest(key), drop)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(merged.to_json())
    os.replace(tmp, path)  # a reader never sees half a file
    return path


class CompileRecorder:
    """Records the specialization of every pressroom kernel Triton's JIT compiles or loads from its disk cache
    while installed; the hook installed before it is still called."""

    def __init__(self) -> None:
        self._entries: dict[str, None] = {}
        self._previous: Any = None
        self._installed = False
        self._lock = threading.Lock()

    def install(self) -> CompileRecorder:
        from triton import knobs
        if not self._installed:
            self._previous = knobs.runtime.jit_post_compile_hook
            knobs.runtime.jit_post_compile_hook = self._hook
            self._installed = True
        return self

    def uninstall(self) -> None:
        from triton import knobs
        if self._installed:
            if knobs.runtime.jit_post_compile_hook == self._hook:
                knobs.runtime.jit_post_compile_hook = self._previous
            self._installed = False

    def __enter__(self) -> CompileRecorder:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _hook(self, **kwargs):
        fn, compile_info = kwargs.get("fn"), kwargs.get("compile") or {}
        data = compile_info.get("specialization_data")
        if data and getattr(fn, "module", "").startswith(_OWN_PREFIX):
            with self._lock:
                self._entries[data] = None
        return self._previous(**kwargs) if self._previous is not None else None

    @property
    def entries(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._entries)  # in the order first compiled: the next start's pool takes them so

    def manifest(self, target: tuple[str, int, int]) -> KernelManifest:
        import triton
        return KernelManifest(target, triton.__version__, self.entries)


@dataclass(frozen=True, slots=True)
class PrecompileResult:
    compiled: int  # kernels the pool compiled into the disk cache
    cached: int  # kernels the disk cache held already
    failed: int  # entries the pool could not compile (the JIT compiles them at their first launch)
    seconds: float
    workers: int
    failed_entries: frozenset[str] = frozenset()  # the next save drops them (a kernel since renamed or removed)


class PrecompileHandle:
    """A precompile running in the background (the JIT claims or waits for the kernels it needs meanwhile);
    `wait` blocks until it is done or the time is up."""

    def __init__(self, future: cf.Future, cancel: threading.Event) -> None:
        self._future, self._cancel = future, cancel

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> None:
        """No more entries are handed out (those compiling finish into the cache)."""
        self._cancel.set()

    def wait(self, timeout: float | None = WAIT_SECONDS) -> PrecompileResult | None:
        """The result, or None if it is not done in `timeout` seconds (the rest is cancelled; kernels already
        compiling finish into the cache) or it failed as a whole (logged)."""
        try:
            return self._future.result(timeout)
        except cf.TimeoutError:
            self._cancel.set()
            logger.warning("Triton kernel precompile not done in %.0f s: the JIT compiles the rest", timeout)
        except Exception as e:  # noqa: BLE001  a start never fails for want of a precompile
            logger.warning("Triton kernel precompile failed (%s: %s): the JIT compiles the kernels",
                           type(e).__name__, e)
        return None


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))


def precompile(manifest: KernelManifest, workers: int | None = None) -> PrecompileHandle:
    """Starts compiling, in `workers` fresh processes, every manifest entry that Triton's disk cache lacks;
    returns at once. An entry that fails is logged and skipped. Until it is done, this process's JIT claims or
    waits for the entries it is about to compile (`_Schedule`)."""
    cancel = threading.Event()
    runner = cf.ThreadPoolExecutor(1, thread_name_prefix="triton-precompile")
    future = runner.submit(_run, manifest, workers or default_workers(), cancel)
    runner.shutdown(wait=False)
    return PrecompileHandle(future, cancel)


def _run(manifest: KernelManifest, workers: int, cancel: threading.Event) -> PrecompileResult:
    import triton
    start = time.perf_counter()
    if manifest.triton_version != triton.__version__:
        logger.warning("Triton kernel manifest from Triton %s, this is %s: not precompiling",
                       manifest.triton_version, triton.__version__)
        return PrecompileResult(0, 0, 0, 0.0, 0)
    todo = []
    for entry in manifest.entries:
        key, cached = _cache_state(entry, manifest.target)
        if not cached:
            todo.append((key, entry))
    cached = len(manifest.entries) - len(todo)
    if not todo:
        return PrecompileResult(0, cached, 0, time.perf_counter() - start, 0)
    workers = min(workers, len(todo))
    schedule = _Schedule(todo)
    with _claims_installed(schedule):
        counts, failed = _CompileProcesses(workers, manifest.target).run(schedule, cancel)
    return PrecompileResult(counts["compiled"], cached + counts["cached"], counts["failed"],
                            time.perf_counter() - start, workers, frozenset(failed))


def _cache_state(entry: str, target: tuple[str, int, int]) -> tuple[str | None, bool]:
    """The key of the kernel's folder in Triton's disk cache and whether it holds the kernel; (None, False) where
    this process cannot tell (a kernel renamed since it was recorded, or this process runs Triton's interpreter):
    a compile process imports it afresh and finds out."""
    try:
        manager, cached = _cache_lookup(entry, target)
        return manager.key, cached
    except Exception as e:  # noqa: BLE001
        logger.debug("Triton kernel %s: cache not checked here (%s: %s)", _entry_name(entry), type(e).__name__, e)
        return None, False


class _Schedule:
    """A precompile's entries not yet handed out or compiling, by the key of their folder in Triton's disk cache
    (None where this process could not compute it). The pool processes take them in order; this process's JIT,
    about to compile a kernel itself, takes a queued one out of the pool's way or waits for a compiling one."""

    def __init__(self, items: list[tuple[str | None, str]]) -> None:
        self._queue = collections.deque(items)
        self._queued = {key for key, _ in items if key is not None}
        self._compiling: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def take(self) -> tuple[str | None, str] | None:
        """The next entry for a pool process (marked compiling), or None when none is left."""
        with self._lock:
            while self._queue:
                key, entry = self._queue.popleft()
                if key is None:
                    return key, entry
                if key in self._queued:  # else the JIT claimed it
                    self._queued.discard(key)
                    self._compiling[key] = threading.Event()
                    return key, entry
            return None

    def done(self, key: str | None) -> None:
        """A pool process is done with the entry under `key` (compiled, cached or failed)."""
        with self._lock:
            event = self._compiling.pop(key, None) if key is not None else None
        if event is not None:
            event.set()

    def claim(self, key: str, timeout: float) -> bool:
        """The JIT is about to compile the kernel under `key`: a queued one leaves the queue (the JIT compiles it);
        for one compiling, waits until it is done or `timeout` passes. Whether it waited."""
        with self._lock:
            if key in self._queued:
                self._queued.discard(key)
                return False
            event = self._compiling.get(key)
        if event is None:
            return False
        event.wait(timeout)
        return True


@contextlib.contextmanager
def _claims_installed(schedule: _Schedule):
    """While the pool runs, Triton's cache lookups in this process claim from `schedule` on a miss (not where a
    cache manager of the user's is set: then the JIT and the pool may both compile a kernel)."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager
    if knobs.cache.manager_class is not None:
        yield
        return

    class ClaimingCache(FileCacheManager):
        def __init__(self, key, override=False, dump=False):
            super().__init__(key, override, dump)
            self._plain = not (override or dump)  # the compile cache, not the IR override or dump folders

        def get_group(self, filename):
            group = super().get_group(filename)
            if group is None and self._plain and schedule.claim(self.key, CLAIM_WAIT_SECONDS):
                group = super().get_group(filename)  # the pool process wrote it (unless it failed)
            return group

    knobs.cache.manager_class = ClaimingCache
    try:
        yield
    finally:
        if knobs.cache.__dict__.get("manager_class") is ClaimingCache:
            del knobs.cache.manager_class


class _CompileProcesses:
    """Fresh interpreters that compile entries sent one per line on stdin, each answering a line on stdout.

    Not multiprocessing's spawn: it re-imports the parent's `__main__`, and a script that builds an LLM at module
    level with no `if __name__ == "__main__":` guard would build it again in every child (executor/process.py's
    FreshProcess avoids it the same way). Children see no GPU: they compile for the recorded target."""

    def __init__(self, count: int, target: tuple[str, int, int]) -> None:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        env.pop("TRITON_INTERPRET", None)  # they compile (where it is set, the JIT recorded nothing to precompile)
        # pressroom's package is entered without its __init__ (the engine, transformers: a second of imports):
        # the kernel modules import only what they need below it
        bootstrap = ("import json, sys, types; sys.path[:] = json.loads(sys.argv[1]); "
                     "package = types.ModuleType('pressroom'); package.__path__ = [sys.argv[3]]; "
                     "sys.modules['pressroom'] = package; "
                     "from pressroom.kernels.triton.precompile import serve_compiles; "
                     "serve_compiles(tuple(json.loads(sys.argv[2])))")
        args = [sys.executable, "-c", bootstrap, json.dumps(sys.path), json.dumps(list(target)), _PACKAGE_DIR]
        self.procs = [subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                       bufsize=1, close_fds=True) for _ in range(count)]

    def run(self, schedule: _Schedule, cancel: threading.Event) -> tuple[collections.Counter, list[str]]:
        """Compiles the schedule's entries over the processes, each taking the next when it is done; how many were
        compiled, found in the cache, failed, and the entries that failed."""
        lock = threading.Lock()
        counts, failed = collections.Counter(), []

        def feed(proc: subprocess.Popen) -> None:
            try:
                # an entry goes to a process only once it has imported what compiling takes: until then the JIT
                # claims the entries it reaches and compiles them itself, rather than waiting on an import
                if json.loads(proc.stdout.readline() or "{}").get("ready") is not True:
                    raise ValueError("the compile process ended before it was ready")
                while not cancel.is_set() and (item := schedule.take()) is not None:
                    key, entry = item
                    try:
                        proc.stdin.write(json.dumps(entry) + "\n")
                        proc.stdin.flush()
                        line = proc.stdout.readline()
                    finally:
                        schedule.done(key)  # the JIT waiting for it goes on (and compiles it itself if it failed)
                    reply = json.loads(line) if line else {"error": "the compile process ended"}
                    error = reply.get("error")
                    with lock:
                        counts["failed" if error else "cached" if reply.get("cached") else "compiled"] += 1
                        if error:
                            failed.append(entry)
                    if error:
                        logger.warning("precompiling Triton kernel %s failed (%s); the JIT compiles it at its first "
                                       "launch", _entry_name(entry), error)
                    if not line:
                        return
            except (OSError, ValueError) as e:  # a child gone: the others take the rest
                logger.warning("a Triton precompile process failed: %s: %s", type(e).__name__, e)
            finally:
                _close(proc)

        threads = [threading.Thread(target=feed, args=(p,), daemon=True) for p in self.procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return counts, failed


def _close(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()  # end of input: the child exits
    except OSError:
        pass
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_compiles(target: tuple[str, int, int]) -> None:
    """A compile process's loop: first {"ready": true} once the imports every compile takes are done, then one entry
    (a JSON string) a line in, one reply a line out: {} (compiled), {"cached": true} or {"error": ...}."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else prints goes to stderr, never into the replies
    import torch  # noqa: F401  the kernel modules' heaviest import
    import triton.compiler  # noqa: F401
    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        try:
            entry = json.loads(line)
            reply = {"cached": True} if is_cached(entry, target) else {}
            if not reply:
                compile_entry(entry, target)
        except Exception as e:  # noqa: BLE001  reported to the parent, which logs it and goes on
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps(reply) + "\n")


def _entry_name(entry: str) -> str:
    try:
        return json.loads(entry)["name"]
    except (ValueError, KeyError, TypeError):
        return "?"


def _jit_function(full_name: str):
    """The JITFunction a specialization names (module.qualname), imported."""
    parts = full_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module holds {full_name}")


def _source_and_options(entry: str, backend):
    """The ASTSource and options the JIT built for this specialization (as JITFunction.preload rebuilds them),
    without a device: what `triton.compile` and the disk cache's key are computed from."""
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, convert_to_tuple_if_list
    obj = json.loads(entry)
    fn = _jit_function(obj["name"])
    if not isinstance(fn, JITFunction):  # Triton's interpreter (TRITON_INTERPRET=1) compiles nothing
        raise TypeError(f"{obj['name']} is a {type(fn).__name__}, not a JITFunction")
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else
        convert_to_tuple_if_list(v)  # a tuple constexpr came back from JSON a list (preload leaves it one)
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: convert_to_tuple_if_list(v) for k, v in obj["signature"].items()}
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), options


def _backend(target: tuple[str, int, int]):
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    return GPUTarget(*target), make_backend(GPUTarget(*target))


def cache_hash(entry: str, target: tuple[str, int, int]) -> str:
    """The hash naming this kernel's folder in Triton's disk cache, as `triton.compile` computes it."""
    return _cache_hash_and_name(entry, target)[0]


def _cache_hash_and_name(entry: str, target: tuple[str, int, int]) -> tuple[str, str]:
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime.cache import get_cache_key
    _, backend = _backend(target)
    src, options = _source_and_options(entry, backend)
    key = get_cache_key(src, backend, options, get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest(), src.name


def _cache_lookup(entry: str, target: tuple[str, int, int]) -> tuple[Any, bool]:
    """The kernel's folder in Triton's disk cache (its cache manager) and whether it holds the kernel's binary
    already (its metadata file, as `compile` looks)."""
    from triton.runtime.cache import get_cache_manager
    digest, name = _cache_hash_and_name(entry, target)
    manager = get_cache_manager(digest)
    return manager, manager.get_group(f"{name[:150]}.json") is not None


def is_cached(entry: str, target: tuple[str, int, int]) -> bool:
    """Whether Triton's disk cache holds this kernel's binary already."""
    return _cache_lookup(entry, target)[1]


def compile_entry(entry: str, target: tuple[str, int, int]) -> str:
    """Compiles one recorded kernel for `target` into Triton's disk cache (in a pool process); its name."""
    import triton
    gpu_target, backend = _backend(target)
    src, options = _source_and_options(entry, backend)
    triton.compile(src, target=gpu_target, options=options.__dict__)
    return src.name


class StartupKernels:
    """One CUDA worker's start: precompiles what earlier starts of this key recorded (in the background, from
    before the weights load; the start never waits for the whole pool), records this start's compiles, and saves
    them merged into the manifest."""

    def __init__(self, key: str, target: tuple[str, int, int], precompile_now: bool = True,
                 workers: int | None = None) -> None:
        self.key, self.target = key, target
        self.recorder = CompileRecorder().install()
        manifest = load_manifest(key) if precompile_now else None
        if manifest is not None and manifest.target != target:
            manifest = None  # the key names the GPU, so only a hand-copied file lands here
        self._handle = precompile(manifest, workers) if manifest is not None and manifest.entries else None
        self.result: PrecompileResult | None = None

    def wait(self, timeout: float = WAIT_SECONDS) -> PrecompileResult | None:
        """Waits for the precompile (once; later calls return at once) and logs what it did."""
        handle, self._handle = self._handle, None
        if handle is None:
            return self.result
        self.result = result = handle.wait(timeout)
        if result is not None:
            logger.info("precompiled %d Triton kernels in %.1f s (%d workers); %d were in the cache, %d failed",
                        result.compiled, result.seconds, result.workers, result.cached, result.failed)
        return result

    def save(self) -> Path | None:
        """Stops recording and saves this start's kernels merged into the manifest (a failure is only logged). A
        precompile not done yet hands out no more entries (every kernel this start needed is compiled by now;
        those compiling finish into the cache) and its failures are not known to drop."""
        self.recorder.uninstall()
        if self._handle is not None and not self._handle.done():
            self._handle.cancel()
        elif self._handle is not None:
            self.wait(0)
        manifest = self.recorder.manifest(self.target)
        if not manifest.entries and not (self.result is not None and self.result.failed_entries):
            return None
        drop = self.result.failed_entries if self.result is not None else frozenset()
        try:
            path = save_manifest(self.key, manifest, drop)
        except Exception as e:  # noqa: BLE001  a start never fails for want of a manifest
            logger.warning("could not save the Triton kernel manifest (%s: %s)", type(e).__name__, e)
            return None
        logger.info("recorded %d Triton kernels of this start in %s", len(manifest.entries), path)
        return path

    def close(self) -> None:
        """Stops recording and hands out no more precompiles (those compiling finish into the cache)."""
        self.recorder.uninstall()
        if self._handle is not None:
            self._handle.cancel()


def start_kernel_precompile(model_identity: str, dtype: str, quantization: str, tensor_parallel_size: int,
                            precompile_now: bool = True) -> StartupKernels | None:
    """A CUDA worker's StartupKernels for the current device (None, warned, if Triton or the device is not
    usable: the JIT compiles as without it)."""
    try:
        import torch
        import triton
        capability = torch.cuda.get_device_capability()
        key = manifest_key(model_identity, dtype, quantization, tensor_parallel_size, torch.cuda.get_device_name(),
                           capability, triton.__version__)
        return StartupKernels(key, ("cuda", capability[0] * 10 + capability[1], 32), precompile_now)
    except Exception as e:  # noqa: BLE001  an optimisation of the start never stops it
        logger.warning("Triton kernel precompile off (%s: %s)", type(e).__name__, e)
        return None
