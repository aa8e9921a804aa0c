"""Speculative decoding's drafters: each proposes tokens the target verifies in its own forward pass.

The drafters implement worker/'s `Proposer` (worker/proposer.py: the runner owns the interface and
never imports a drafter). The executor hands `make_proposer` to each worker as its factory, and the worker
builds the configured drafter for its runner. Scheduling policy (the adaptive budget, calibration) lives
in core/; drafter training in training/.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pressroom.config import SpeculativeConfig

if TYPE_CHECKING:
    from pressroom.worker.model_runner import ModelRunner
    from pressroom.worker.proposer import Proposer


def make_proposer(config: SpeculativeConfig | None, target: ModelRunner) -> Proposer | None:
    """The drafter `config` names, for the `target` runner (a draft model shares its device, dtype and
    block size; dflash2 reads its model's embedding and LM head). Each drafter is imported only when chosen."""
    if config is None:
        return None
    if config.method == "ngram":
        from pressroom.spec_decode.ngram import NgramProposer
        return NgramProposer(config)
    if config.method == "draft_model":
        from pressroom.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(config, target)
    if config.method == "mtp":
        from pressroom.spec_decode.mtp import MTPProposer
        return MTPProposer(config, target)
    if config.method == "dflash2":
        from pressroom.spec_decode.dflash2 import DFlash2Proposer
        return DFlash2Proposer(config, target)
    if config.method == "dspark":
        from pressroom.spec_decode.dspark import DSparkProposer
        return DSparkProposer(config, target)
    raise ValueError(f"Unknown speculative method {config.method!r}.")
