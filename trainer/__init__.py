"""Trainer: RL, SFT and distillation losses, weight publishing, checkpoints."""
