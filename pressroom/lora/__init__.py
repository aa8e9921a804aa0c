"""LoRA adapters over one base model (PEFT checkpoints), many served at once: `request.py` (what a request
names), `adapter.py` (a PEFT checkpoint read and checked against the model), `layers.py` (the batched
low-rank updates on the model's linear layers), `manager.py` (the worker's slots and its CPU pool)."""
