"""Message broker: worker registry, run status, durable rollout stream, weight fan-out."""
