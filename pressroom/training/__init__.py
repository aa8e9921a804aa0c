"""Offline tools that make drafters: prompt generation (`pressroom make-prompts`) and drafter training
(`pressroom train-drafter`). The serving runtime never imports this package."""
