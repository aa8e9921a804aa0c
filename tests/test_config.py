"""Configs: each default written once (EngineArgs reads it from the config class), frozen keyword-only
dataclasses, and a resolution that changes nothing: no threads set, no log, no file read."""
from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from pressroom import config as cfg
from pressroom.config import (
    CheckpointFacts,
    EngineArgs,
    EngineConfig,
    SchedulerConfig,
    default_of,
    read_checkpoint_facts,
)
from pressroom.engine.llm_engine import start_config

CONFIGS = (cfg.ModelConfig, cfg.CacheConfig, cfg.CompilationConfig, cfg.SchedulerConfig, cfg.ParallelConfig,
           cfg.SpeculativeConfig, cfg.OffloadTierSpec, cfg.OffloadConfig, cfg.LoRAConfig, cfg.EngineConfig,
           cfg.CheckpointFacts,
           cfg.EngineArgs)
# A value other than the default for each argument that a config field takes as it is.
OTHER_VALUES = {"tokenizer": "tok", "load_format": "dummy", "quantization": "none", "max_model_len": 64, "seed": 7,
                "skip_tokenizer_init": True, "batch_invariant": True, "block_size": 32,
                "enable_prefix_caching": False, "gpu_memory_utilization": 0.5, "num_gpu_blocks_override": 9,
                "scheduling_policy": "priority", "tensor_parallel_size": 2, "enable_expert_parallel": True,
                "data_parallel_size": 2, "num_threads": 3, "enforce_eager": True, "max_cudagraph_capture_size": 64,
                "mamba_block_size": 64, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 4, "cpu_offload_gb": 2.5,
                "max_logprobs": 5, "enable_sleep_mode": True, "enable_mfu_metrics": True,
                "precompile_kernels": False}


def _sets() -> dict[str, tuple[type, str]]:
    """EngineArgs field -> (config class, field) it sets as it is."""
    return {f.name: f.metadata["sets"] for f in dataclasses.fields(EngineArgs) if "sets" in f.metadata}


def _part(config: EngineConfig, kind: type):
    if kind is EngineConfig:
        return config
    (part,) = [getattr(config, f.name) for f in dataclasses.fields(config) if isinstance(getattr(config, f.name), kind)]
    return part


def test_an_argument_that_sets_a_config_field_has_that_fields_default():
    for name, (kind, field_name) in _sets().items():
        assert EngineArgs.__dataclass_fields__[name].default == default_of(kind, field_name), name


def test_no_argument_writes_a_second_default_of_a_config_field():
    """An argument named as a config field either takes that field's default (declared with _config_arg) or
    leaves the value to the resolution (None or "auto": decided by the device or the checkpoint)."""
    config_fields = {f.name for kind in CONFIGS[:-2] for f in dataclasses.fields(kind)}
    for f in dataclasses.fields(EngineArgs):
        if f.name in config_fields and "sets" not in f.metadata:
            assert f.default in (None, "auto"), f"EngineArgs.{f.name} writes its own default {f.default!r}"


def test_every_argument_that_sets_a_field_reaches_it():
    assert set(OTHER_VALUES) == set(_sets())  # a new such argument needs a value here
    for name, (kind, field_name) in _sets().items():
        value = OTHER_VALUES[name]
        assert value != EngineArgs.__dataclass_fields__[name].default, name
        on = {"enable_lora": True} if kind is cfg.LoRAConfig else {}  # the LoRA config exists only then
        config = EngineArgs(model="m", device="cpu", **on, **{name: value}).create_engine_config()
        assert getattr(_part(config, kind), field_name) == value, name


def test_device_dependent_defaults_come_from_the_scheduler_config():
    cpu = EngineArgs(device="cpu", num_threads=1).create_engine_config().scheduler
    assert cpu.max_num_seqs == default_of(SchedulerConfig, "max_num_seqs")
    assert cfg.default_max_num_batched_tokens("cuda", 1) == default_of(SchedulerConfig, "max_num_batched_tokens")
    assert cfg.default_max_num_seqs("cuda") == cfg.CUDA_MAX_NUM_SEQS


@pytest.mark.parametrize("kind", CONFIGS, ids=lambda k: k.__name__)
def test_configs_are_frozen_and_built_by_keyword(kind):
    params = kind.__dataclass_params__
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(kind))
    assert "__slots__" in vars(kind)


def test_a_resolved_config_cannot_change_but_can_be_replaced():
    config = EngineArgs(model="m", device="cpu").create_engine_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scheduler.max_model_len = 8
    longer = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_model_len=8))
    assert longer.scheduler.max_model_len == 8 and config.scheduler.max_model_len == 0
    with pytest.raises(ValueError, match="max_num_seqs"):
        dataclasses.replace(config.scheduler, max_num_seqs=0)  # a replaced config is validated again


def test_the_executor_backend_is_resolved_by_the_rank_count():
    assert EngineArgs(model="m", device="cpu").create_engine_config().parallel.distributed_executor_backend == "uni"
    two = EngineArgs(model="m", device="cpu", tensor_parallel_size=2).create_engine_config()
    assert two.parallel.distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match="one process per rank"):
        cfg.ParallelConfig(tensor_parallel_size=2)


@pytest.fixture
def bert_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    return str(tmp_path)


def test_resolution_sets_no_threads_logs_nothing_and_reads_no_file(bert_dir, caplog):
    threads = torch.get_num_threads()
    with caplog.at_level(logging.DEBUG):
        config = EngineArgs(model=bert_dir, device="cpu", num_threads=threads + 3).create_engine_config()
    assert torch.get_num_threads() == threads and not caplog.records
    assert not config.model.encoder_only and config.model.runner == "generate"  # config.json was not read
    # the step budget follows the threads asked for, not those torch has now
    assert config.scheduler.max_num_batched_tokens == max(cfg.CPU_MIN_BATCHED_TOKENS,
                                                          cfg.CPU_TOKENS_PER_THREAD * (threads + 3))


def test_the_checkpoints_facts_are_read_in_a_step_of_their_own(bert_dir):
    assert read_checkpoint_facts(bert_dir) == CheckpointFacts(encoder_only=True)
    assert read_checkpoint_facts("/nonexistent") == CheckpointFacts()
    config = EngineArgs(model=bert_dir, device="cpu").create_engine_config(read_checkpoint_facts(bert_dir))
    assert config.model.encoder_only and config.model.runner == "pooling"
    assert config.scheduler.max_num_batched_tokens == cfg.ENCODER_BATCHED_TOKENS


def test_the_engines_start_reads_the_checkpoint_sets_threads_and_logs_the_cpu_path(bert_dir, caplog):
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="pressroom"):
            config = start_config(EngineArgs(model=bert_dir, device="cpu", dtype="float32", num_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert config.model.runner == "pooling"
    assert any("dtype float32 (as asked)" in r.getMessage() for r in caplog.records)


def test_decode_graphs_follow_vllms_ladder():
    """1, 2, 4, every 8 below 256, every 16 from 256, ending at the limit (max_num_seqs or the capture size)."""
    from pressroom.config import CompilationConfig
    sizes = CompilationConfig().capture_sizes(1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and len(sizes) == 51
    assert {b - a for a, b in zip(sizes[3:], sizes[4:]) if b <= 256} == {8}
    assert {b - a for a, b in zip(sizes, sizes[1:]) if a >= 256} == {16}
    assert CompilationConfig().capture_sizes(100)[-2:] == [96, 100]  # the limit closes the ladder
    assert CompilationConfig(max_cudagraph_capture_size=1024).capture_sizes(1024)[-1] == 1024
