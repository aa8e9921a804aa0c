"""Models by hub repository id, as vLLM takes them: a repository in an HF cache (huggingface_hub's layout: refs,
snapshots by commit, blobs) served by `org/name` with HF_HUB_OFFLINE=1, at a revision, from --download-dir; a
repository not in the cache offline is a clear error. huggingface_hub's own scan_cache_dir reads the cache first
(the layout is its)."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pressroom import LLM, SamplingParams


def write_hub_cache(cache: Path, repo_id: str, source: Path, commit: str, branch: str = "main") -> Path:
    """`source`'s files as huggingface_hub caches a download of `repo_id` at `commit` (its files as blobs named by
    their hash, linked from the snapshot), `branch` pointing at it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in source.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot


def test_a_cached_repository_serves_by_id_offline(tiny_model_dir, tmp_path, monkeypatch):
    from huggingface_hub import scan_cache_dir
    cache = tmp_path / "hub"
    write_hub_cache(cache, "tiny-org/tiny-llama", Path(tiny_model_dir("llama")), "a" * 40)
    write_hub_cache(cache, "tiny-org/tiny-llama", Path(tiny_model_dir("qwen3")), "b" * 40, branch="v2")
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert {rev.commit_hash for rev in repos["tiny-org/tiny-llama"].revisions} == {"a" * 40, "b" * 40}
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama", download_dir=str(cache), dtype="float32", kv_cache_memory_gib=0.02)
    assert by_id.engine.model_path.endswith("snapshots/" + "a" * 40)
    local = LLM(tiny_model_dir("llama"), dtype="float32", kv_cache_memory_gib=0.02)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    assert by_id.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        local.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    by_id.shutdown()
    local.shutdown()
    at_v2 = LLM("tiny-org/tiny-llama", revision="v2", download_dir=str(cache), dtype="float32",
                kv_cache_memory_gib=0.02)
    assert at_v2.engine.hf_config.model_type == "qwen3"
    at_v2.shutdown()
    with pytest.raises(ValueError, match=r"'tiny-org/absent' is not in .* HF_HUB_OFFLINE is set"):
        LLM("tiny-org/absent", download_dir=str(cache))
