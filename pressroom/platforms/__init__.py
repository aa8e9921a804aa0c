"""Facts about the hardware pressroom runs on, read once (CPU tiers; CUDA is asked of torch directly)."""
