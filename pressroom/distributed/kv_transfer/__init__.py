"""KV connectors: a request's KV moved between engines (disaggregated prefill and decode), in the shape of vLLM's
V1 KVConnector. `base.py` holds the interface (a scheduler side and a worker side) and the kv_transfer_params a
request carries; `nixl_connector.py` the connector over NIXL; `staging.py` the host buffer of chunks (the canonical
layout of kv_offload/layout.py) that a producer fills and a consumer reads; `worker_side.py` a rank's copies between
its device blocks and that buffer; `media_transfer.py` E/P/D: media items' encoder outputs, keyed by their content
hashes, staged by an encode engine and read by a prefill engine through the same buffer and agent."""
