"""Tiered KV-cache offload: the device cache's blocks kept in host memory (the primary CPU tier) and, behind
it, in secondary tiers (a filesystem tier that survives restarts; out-of-tree tiers by module path).

Policy: when a request releases its blocks (finished, aborted or preempted), its full computed blocks that
no tier holds yet are copied to the CPU tier before any of them can be reused, and the CPU tier writes
them through to every secondary tier in the background. A prompt's prefix lookup goes on past the device's
prefix cache into the tiers, in order: chunks in the CPU tier are copied into device blocks at the start
of the request's first step; chunks only a secondary tier holds are first read into the CPU tier while
the request waits and the batch goes on. A chunk is one device block's KV in a canonical layout (see
layout.py), keyed by its chained block hash under a model fingerprint (a hash of the weights' content and
all else that determines KV); a chunk carries its key, and one read under another key is not served.
"""
