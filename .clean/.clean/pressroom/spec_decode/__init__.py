"""Speculative decoding: proposers draft tokens, the target verifies them in its own forward pass.

The drafters implement worker/'s `Proposer` (worker/proposer.py: the runner owns the interface and
never imports a drafter); the engine builds the configured one here, above both, and hands it to the
target's runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pressroom.config import SpeculativeConfig

if TYPE_CHECKING:
    from pressroom.worker.model_runner import ModelRunner
    from pressroom.worker.proposer import Proposer


def make_proposer(config: SpeculativeConfig | None, target: ModelRunner) -> Proposer | None:
    """The drafter `config` names, for the `target` runner (a draft model shares its device, dtype and
    block size; dflash2 reads its model's embedding and LM head). Drafters are imported here, not at the
    top: the scheduler imports spec_decode's budget, and must not load runners and models with it."""
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
    raise ValueError(f"Unknown speculative method {config.method!r}.")
