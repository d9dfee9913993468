"""Inference worker: a vLLM engine that serves rollouts and applies weight updates in flight."""
