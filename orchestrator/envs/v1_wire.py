"""The verifiers v1 env server's wire (verifiers 0.4, `verifiers.v1.serve`), as the orchestrator speaks it without
importing verifiers: ZeroMQ DEALER -> the server's ROUTER, msgpack payloads.

    request:  [request_id, method, msgpack(payload)]        method: b"health" | b"run" | b"cancel"
    answer:   [request_id, b"delta", msgpack(delta)] ...    zero or more (only for `run`)
              [request_id, b"reply", msgpack(reply)]        exactly one; {"success": bool, "error": str|None, ...}

`run` payload (one rollout): {"task_data": {...}, "client": {"type": "train", "base_url", "api_key_var",
"headers", "renderer_model_name"}, "model": str, "sampling": {...}}; its reply {"head": episode without traces,
"traces": [{"id", "nodes", "calls"}]}. `cancel` payload {"request_id": str}; reply {"cancelled": bool}.

A delta grows one trace (verifiers' `serve.delta.DeltaStreamer`): {"trace": id, "open": header (first delta),
"nodes"/"calls"/"errors"/...: appended items, "set": changed scalar fields, "links": {node index: links},
"pending": preview, "discard": true (a retried attempt's trace)}. `EpisodeAssembly` applies them (the same rules as
verifiers' own `serve.delta.EpisodeAssembly`, minus MoE routing repairs, which training here does not read).
"""

from __future__ import annotations

from typing import Any

import msgpack

METHOD_HEALTH = b"health"
METHOD_RUN = b"run"
METHOD_CANCEL = b"cancel"
KIND_DELTA = b"delta"
KIND_REPLY = b"reply"

LIST_FIELDS = ("nodes", "calls", "errors", "extra_usage", "request_rewrites", "response_rewrites")
"""Trace fields a delta appends to (verifiers `serve.delta.LIST_FIELDS`)."""


class MalformedEpisode(ValueError):
    """The deltas and the reply of a run do not add up to an episode (a lost or garbled message)."""


def pack(payload: Any) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """Decode a payload; node updates are keyed by int (hence no strict map keys). Raises ValueError on bad
    bytes."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
        raise ValueError(f"undecodable msgpack payload: {exc}") from None


class EpisodeAssembly:
    """The growing picture of one run's episode: raw trace dicts in arrival order."""

    def __init__(self) -> None:
        self.traces: dict[str, dict] = {}
        self.num_deltas = 0

    def apply(self, delta: Any) -> None:
        if not isinstance(delta, dict) or not isinstance(delta.get("trace"), str):
            raise MalformedEpisode(f"a delta must be a map with a trace id, got {type(delta).__name__}")
        self.num_deltas += 1
        trace_id = delta["trace"]
        if delta.get("discard"):
            self.traces.pop(trace_id, None)
            return
        trace = self.traces.get(trace_id)
        if trace is None:
            if not isinstance(delta.get("open"), dict):
                raise MalformedEpisode(f"the first delta of trace {trace_id} has no header")
            trace = self.traces[trace_id] = {**delta["open"], **{name: [] for name in LIST_FIELDS}}
        for index, links in (delta.get("links") or {}).items():
            trace["nodes"][int(index)].setdefault("semantic_parents", []).extend(links)
        if "nodes" in delta:
            trace["nodes"].extend(
                {**node, "semantic_parents": list(node.get("semantic_parents") or [])} for node in delta["nodes"]
            )
        for name in LIST_FIELDS:
            if name in delta and name != "nodes":
                trace[name].extend(delta[name])
        trace.update(delta.get("set") or {})

    def finish(self, reply: dict) -> dict:
        """The episode: the reply's head joined with the assembled traces in the server's order."""
        head = reply.get("head") or {}
        traces = []
        for summary in reply.get("traces") or []:
            trace = self.traces.get(summary.get("id"))
            if trace is None:
                raise MalformedEpisode(f"the episode is missing trace {summary.get('id')}")
            if len(trace["nodes"]) != summary.get("nodes") or len(trace["calls"]) != summary.get("calls"):
                raise MalformedEpisode(
                    f"trace {summary.get('id')} assembled {len(trace['nodes'])} nodes / {len(trace['calls'])} "
                    f"calls, the server reports {summary.get('nodes')} / {summary.get('calls')}"
                )
            traces.append(trace)
        return {**head, "traces": traces}
