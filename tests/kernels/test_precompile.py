"""Triton kernels precompiled in other processes from a manifest of earlier starts (issue 44: time to ready).

The crux: a kernel compiled by a compile process from its recorded specialization lands in Triton's disk cache
under the key the JIT computes for the same launch, so the JIT's compile is a cache hit. No GPU is needed:
Triton compiles for an H100's target (ptxas ships in its wheel)."""
from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
import triton.language as tl

from pressroom.kernels.triton import precompile as pc

H100 = ("cuda", 90, 32)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """A fresh pressroom cache (manifests) and Triton cache for the test."""
    monkeypatch.setenv("PRESSROOM_CACHE", str(tmp_path / "pressroom"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    return tmp_path


def _manifest(*entries: str) -> pc.KernelManifest:
    import triton
    return pc.KernelManifest(H100, triton.__version__, tuple(entries))


def test_a_save_puts_this_starts_entries_before_the_saved_ones(caches, monkeypatch):
    pc.save_manifest("k", _manifest("a", "b"))
    pc.save_manifest("k", _manifest("c", "a"))
    assert pc.load_manifest("k").entries == ("c", "a", "b")
    monkeypatch.setattr(pc, "MANIFEST_CAP", 3)
    pc.save_manifest("k", _manifest("d"))
    assert pc.load_manifest("k").entries == ("d", "c", "a")  # the cap keeps the last starts'
    assert pc.load_manifest("other") is None
    # another target's or Triton's entries are not merged into this one's
    pc.save_manifest("k", pc.KernelManifest(H100, "0.0", ("x",)))
    assert pc.load_manifest("k").entries == ("x",)


def test_a_truncated_manifest_is_ignored_with_a_warning(caches, caplog):
    pc.save_manifest("k", _manifest("a", "b"))
    path = pc.manifest_path("k")
    path.write_text(path.read_text()[:20])
    with caplog.at_level(logging.WARNING, logger="pressroom"):
        assert pc.load_manifest("k") is None
    assert "cannot be read" in caplog.text
    pc.save_manifest("k", _manifest("c"))  # and a save replaces it
    assert pc.load_manifest("k").entries == ("c",)


def test_the_key_names_the_model_dtype_quantization_tp_gpu_and_triton():
    base = dict(model_identity=json.dumps({"hidden_size": 64}), dtype="torch.bfloat16", quantization="auto",
                tensor_parallel_size=1, gpu_name="NVIDIA H100 80GB HBM3", capability=(9, 0), triton_version="3.6.0")
    key = pc.manifest_key(**base)
    assert key == pc.manifest_key(**base)
    for field, value in (("model_identity", json.dumps({"hidden_size": 128})), ("dtype", "torch.float16"),
                         ("quantization", "fp8"), ("tensor_parallel_size", 2), ("gpu_name", "NVIDIA H200"),
                         ("capability", (10, 0)), ("triton_version", "3.5.0")):
        assert pc.manifest_key(**{**base, field: value}) != key, field


def _not_ours(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), 0)


def test_the_recorder_keeps_pressroom_kernels_and_calls_the_hook_before_it():
    """Triton's own `_call_hook` (what `_do_compile` calls after each compile) feeds the recorder."""
    from triton import knobs
    from triton.runtime.jit import JITFunction
    fn, (signature, constexprs, attrs), options, entry = _jit_launch(256)
    theirs = JITFunction(_not_ours)
    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with pc.CompileRecorder() as recorder:
            for kernel, sig, consts, ats in ((fn, signature, constexprs, attrs),
                                             (theirs, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {(1,): 64}, {})):
                key = json.loads(entry)["key"]
                kernel._call_hook(knobs.runtime.jit_post_compile_hook, key, sig, 0, consts, options, [ats], False)
            hook = knobs.runtime.jit_post_compile_hook
        assert recorder.entries == (entry,)  # the JIT's specialization, pressroom's kernels only
        assert seen == ["_silu_and_mul_kernel", "_not_ours"]  # chained, for every kernel
        assert knobs.runtime.jit_post_compile_hook is not hook  # uninstalled: the earlier hook is back
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def _jit_launch(block: int):
    """What Triton's JIT builds for a launch of silu_and_mul's kernel on an H100 (JITFunction.run's steps up to
    `_do_compile`): the function, its ASTSource's parts and options, and the specialization JSON its
    post-compile hook gets. The test process runs Triton's interpreter, so the JITFunction is made here from
    the kernel's Python function (it calls no other kernel, so its cache key is the module's)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import (
        JITFunction,
        compute_cache_key,
        create_function_from_signature,
        get_full_name,
        serialize_specialization_data,
    )

    from pressroom.kernels.triton import activation
    kernel = activation._silu_and_mul_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    backend = make_backend(GPUTarget(*H100))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    x, out = torch.empty(4, 2 * block, dtype=torch.bfloat16), torch.empty(4, block, dtype=torch.bfloat16)
    kwargs = {"num_warps": 4, "debug": knobs.runtime.debug,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}
    bound, specialization, options = binder(x, out, x.stride(0), out.stride(0), block, BLOCK=block, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    entry = serialize_specialization_data(get_full_name(fn), signature, constexprs, attrs, options, key)
    return fn, (signature, constexprs, attrs), options, entry


def _files(root: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_precompiled_kernel_is_the_jits_cache_hit(caches):
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, (signature, constexprs, attrs), options, entry = _jit_launch(256)
    bad = json.loads(_jit_launch(128)[3])
    bad["constant_vals"] = [100]  # tl.arange needs a power of two: this one fails to compile
    missing = json.loads(entry) | {"name": "pressroom.kernels.triton.activation._no_such_kernel"}
    manifest = _manifest(entry, json.dumps(bad), json.dumps(missing))

    result = pc.precompile(manifest, workers=2).wait(120)
    assert (result.compiled, result.cached, result.failed, result.workers) == (1, 0, 2, 2)
    before = _files(caches / "triton")
    assert any(p.endswith(".cubin") for p in before)

    # the JIT's own compile of that launch (what `_do_compile` calls) finds it in the disk cache
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        start = time.perf_counter()
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(*H100),
                                options=options.__dict__)
        seconds = time.perf_counter() - start
    finally:
        knobs.compilation.listener = None
    assert hits == [True]
    assert _files(caches / "triton") == before  # nothing written: nothing compiled
    assert kernel.asm["cubin"] and seconds < 1.0

    # a warm start compiles nothing (this process runs Triton's interpreter, so a compile process looks)
    again = pc.precompile(manifest, workers=1).wait(60)
    assert (again.compiled, again.cached, again.failed) == (0, 1, 2)


def test_startup_kernels_precompile_what_the_last_start_saved(caches, caplog):
    """The worker's side: a start with a saved manifest precompiles it and logs it; an entry that failed (its
    kernel since removed) leaves the manifest at the next save."""
    entry = _jit_launch(512)[3]
    gone = json.dumps(json.loads(entry) | {"name": "pressroom.kernels.triton.activation._removed_kernel"})
    pc.save_manifest("k", _manifest(entry, gone))
    with caplog.at_level(logging.INFO, logger="pressroom"):
        kernels = pc.StartupKernels("k", H100, workers=1)
        try:
            result = kernels.wait(120)
        finally:
            kernels.close()
    assert (result.compiled, result.failed) == (1, 1) and result.failed_entries == {gone}
    assert "precompiled 1 Triton kernels in" in caplog.text and "(1 workers)" in caplog.text
    assert "_removed_kernel failed" in caplog.text
    kernels.save()  # this start recorded nothing (Triton's interpreter runs this process's kernels)
    assert pc.load_manifest("k").entries == (entry,)


def _cache_key(fn, parts, options) -> str:
    """The key of the folder `triton.compile` looks up for this launch (what `_cache_state` computes)."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager
    key = get_cache_key(ASTSource(fn, *parts), make_backend(GPUTarget(*H100)), options,
                        get_cache_invalidating_env_vars())
    return get_cache_manager(hashlib.sha256(key.encode()).hexdigest()).key


def _jit_lookup(fn, parts, options) -> dict | None:
    """The disk-cache lookup `triton.compile` makes for the launch before it compiles anything (its cache manager's
    get_group of the kernel's metadata file): what the claim hooks. Compiling in this process is left out: the
    suite's interpreter runs leave Triton's language patched for it."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key, get_cache_manager
    src = ASTSource(fn, *parts)
    key = get_cache_key(src, make_backend(GPUTarget(*H100)), options, get_cache_invalidating_env_vars())
    return get_cache_manager(hashlib.sha256(key.encode()).hexdigest()).get_group(f"{src.name[:150]}.json")


def _jit_compile(fn, parts, options) -> list[bool]:
    """`triton.compile` of the launch as the JIT's `_do_compile` calls it; its cache hits (one per compile)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    try:
        triton.compile(ASTSource(fn, *parts), target=GPUTarget(*H100), options=options.__dict__)
    finally:
        knobs.compilation.listener = None
    return hits


def test_the_schedule_hands_out_in_order_and_the_jit_claims_or_waits():
    schedule = pc._Schedule([("a", "A"), (None, "N"), ("b", "B"), ("c", "C")])
    assert schedule.take() == ("a", "A")
    assert schedule.claim("b", 1.0) is False  # queued: the JIT takes it and compiles it itself
    assert schedule.take() == (None, "N") and schedule.take() == ("c", "C")  # b is not handed out
    assert schedule.take() is None
    assert schedule.claim("zz", 1.0) is False  # not the precompile's: nothing to wait for
    threading.Timer(0.3, schedule.done, args=("c",)).start()
    start = time.perf_counter()
    assert schedule.claim("c", 30.0) is True  # compiling: waits for the pool process
    assert 0.2 < time.perf_counter() - start < 20
    schedule.done("a")
    assert schedule.claim("a", 30.0) is False  # done: the disk cache has it


def test_the_jit_waits_for_the_kernel_a_pool_process_is_compiling(caches, monkeypatch):
    fn, parts, options, entry = _jit_launch(1024)
    key = _cache_key(fn, parts, options)
    schedule = pc._Schedule([(key, entry)])
    waited = []
    claim = schedule.claim
    monkeypatch.setattr(schedule, "claim", lambda k, t: waited.append(claim(k, t)) or waited[-1])
    with pc._claims_installed(schedule):
        pool = threading.Thread(target=pc._CompileProcesses(1, H100).run, args=(schedule, threading.Event()))
        pool.start()
        while schedule._queue:  # the pool process took it
            time.sleep(0.01)
        hits = _jit_compile(fn, parts, options)
        pool.join(120)
    assert waited == [True] and hits == [True]  # waited for it, then loaded what the pool process compiled
    from triton import knobs
    assert knobs.cache.manager_class is None  # Triton's own cache manager is back


def test_the_jit_takes_a_queued_kernel_out_of_the_pools_way(caches):
    """A pool process gets an entry only once it is ready (its imports done): the JIT, reaching the kernel first,
    finds it missing from the disk cache and takes it to compile itself, rather than waiting on a process's
    imports, and the pool compiles nothing."""
    fn, parts, options, entry = _jit_launch(2048)
    schedule = pc._Schedule([(_cache_key(fn, parts, options), entry)])
    results = []
    with pc._claims_installed(schedule):
        pool = threading.Thread(target=lambda: results.append(
            pc._CompileProcesses(1, H100).run(schedule, threading.Event())))
        pool.start()  # its process is still importing torch
        assert _jit_lookup(fn, parts, options) is None  # a miss at once: the JIT compiles it (not waited for)
        pool.join(120)
    counts, failed = results[0]
    assert sum(counts.values()) == 0 and failed == []  # no pool process compiled it again
