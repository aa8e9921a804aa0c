"""The runner's side of the proposer interface: what it takes, and what a proposer declares."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pressroom.worker.model_runner import ModelRunner
from pressroom.worker.proposer import Proposer


class _HostDrafter(Proposer):
    def propose(self, requests):
        return {}

    def forget(self, req_ids):
        pass


class _DeviceDrafter(_HostDrafter):
    works_on_device = True

    def aux_layers(self):
        return (2, 0)


def _runner(async_scheduling: bool) -> ModelRunner:
    return ModelRunner(nn.Linear(2, 2), block_size=16, dtype=torch.float32, async_scheduling=async_scheduling)


def test_host_drafter_declares_no_device_drafting_nor_features():
    drafter = _HostDrafter()
    assert not drafter.works_on_device and drafter.aux_layers() == ()
    with pytest.raises(NotImplementedError):
        drafter.propose_on_device(None)


def test_async_runner_takes_only_drafters_that_work_on_the_device():
    with pytest.raises(ValueError, match="_HostDrafter.*synchronous scheduling"):
        _runner(async_scheduling=True).set_proposer(_HostDrafter())
    runner = _runner(async_scheduling=True)
    runner.set_proposer(_DeviceDrafter())
    assert runner.device_drafting


def test_runner_asks_the_target_for_the_proposers_layers():
    runner = _runner(async_scheduling=False)
    assert runner._aux_layers() == ()
    runner.set_proposer(_DeviceDrafter())
    assert not runner.device_drafting and runner._aux_layers() == (2, 0)
    runner.set_proposer(None)
    assert runner.proposer is None and runner._aux_layers() == ()
