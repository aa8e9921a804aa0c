"""Speculative decoding: proposers draft tokens, the target verifies them in its own forward pass."""
