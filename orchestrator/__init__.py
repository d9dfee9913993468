"""Orchestrator: environments, async rollouts, advantages, filtering, packing."""
