"""The env worker's per-request trims, on unless ``LEAN_ENV`` is ``0``: the loaded heap frozen, verifiers' named-args
calls with signatures read once, and model clients that parse each URL once and keep no cookies. Runs in the
environments' interpreter (standard library, verifiers and what it brings; nothing else of primerl)."""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import os
import types
from typing import Any

LEAN_ENV = "PRIMERL_ENV_WORKER_LEAN"
"""``0`` in the env worker's environment goes back to the rollout path as it was before the per-request trims
(the loaded heap not frozen, `freeze_loaded_heap`; verifiers' ``maybe_call_with_named_args`` reading each
callee's signature on every call; the openai and httpx clients as they come, parsing each request's URL twice and
running httpx's cookie jar). Kept for before/after
benches (``bench/rollout_path.py --compare-lean``); results are the same either way."""
URL_CACHE_SIZE = 64
SIGNATURE_CACHE_SIZE = 4096


def lean() -> bool:
    """Whether the per-request trims are on (`LEAN_ENV`; on unless it is ``0``)."""
    return os.environ.get(LEAN_ENV, "1").strip() != "0"


@functools.cache
def lean_http_client_class(base: type) -> type:
    """``base`` (an ``httpx.AsyncClient``) without the per-request work a model client never needs.

    Profiled in the env worker of the demo (py-spy, 20 s of a steady ``primerl rl``): httpx parses the absolute
    URL the openai client hands it on every request (``URL.__init__`` -> ``urlparse`` -> ``quote``, whose
    ``re.finditer`` of a compiled pattern misses ``re``'s cache every time), and runs every response through its
    cookie jar (``Cookies.extract_cookies`` builds a ``urllib`` request to do it), together about 8% of the
    worker's CPU. primerl-infer sets no cookies and an OpenAI-compatible endpoint has no use for them, so this
    client keeps none: responses' ``Set-Cookie`` is ignored and requests carry no ``Cookie`` header. An absolute
    URL is parsed once and the (immutable) ``httpx.URL`` reused; relative URLs are merged with ``base_url`` as
    httpx does."""
    import httpx

    class _NoCookies(httpx.Cookies):
        def extract_cookies(self, response: Any) -> None:
            return None

        def set_cookie_header(self, request: Any) -> None:
            return None

    class LeanHttpClient(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if kwargs.get("cookies"):
                raise ValueError("model clients keep no cookies: pass none")
            super().__init__(*args, **kwargs)
            self._primerl_no_cookies = _NoCookies()
            self._primerl_urls: dict[str, Any] = {}

        @property
        def cookies(self) -> Any:
            return self._primerl_no_cookies

        @cookies.setter
        def cookies(self, value: Any) -> None:
            raise ValueError("model clients keep no cookies")

        def _merge_url(self, url: Any) -> Any:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                return super()._merge_url(url)
            merged = self._primerl_urls.get(url)
            if merged is None:
                merged = super()._merge_url(url)
                if len(self._primerl_urls) < URL_CACHE_SIZE:
                    self._primerl_urls[url] = merged
            return merged

    LeanHttpClient.__name__ = LeanHttpClient.__qualname__ = f"Lean{base.__name__}"
    return LeanHttpClient


@functools.cache
def lean_openai_class() -> type:
    """``AsyncOpenAI`` that merges a request path with its ``base_url`` once per path and reuses the (immutable)
    URL, instead of parsing it again on every request (``_prepare_url``: about 10% of the env worker's CPU in the
    profile of `lean_http_client_class`)."""
    from openai import AsyncOpenAI

    class LeanAsyncOpenAI(AsyncOpenAI):
        _primerl_urls: tuple[Any, dict[str, Any]] | None = None  # (the base URL, path -> merged URL)

        def _prepare_url(self, url: str) -> Any:
            base = self.base_url
            cache = self._primerl_urls
            if cache is None or cache[0] is not base:
                cache = self._primerl_urls = (base, {})
            prepared = cache[1].get(url)
            if prepared is None:
                prepared = super()._prepare_url(url)
                if len(cache[1]) < URL_CACHE_SIZE:
                    cache[1][url] = prepared
            return prepared

    return LeanAsyncOpenAI


def freeze_loaded_heap() -> bool:
    """Once the environment and its datasets are loaded: move every object alive to the collector's permanent
    generation (``gc.freeze``), when `lean`; True when it froze.

    Loading verifiers and an environment leaves ~320,000 objects tracked by the cyclic collector, and every
    full collection, triggered by the allocations of the rollouts, walked them all again: the env worker's CPU per
    rollout was 1.42-1.60 ms with them and 1.07-1.18 ms frozen (reverse-text, 8 groups x 8 at a time against a
    local stub server, three runs each). What is loaded stays loaded for the worker's life; objects made later
    are collected as before. No full collection first (it costs ~0.2 s at start-up): the garbage alive at this
    moment, if any, stays (once, a bounded amount). vLLM's engine core freezes its heap too."""
    if not lean():
        return False
    gc.freeze()
    return True


# The verifiers modules that call `maybe_call_with_named_args` through a module-level name (verifiers 0.3.1).
_NAMED_ARGS_CALLERS = (
    "verifiers.legacy.utils.async_utils",
    "verifiers.legacy.envs.environment",
    "verifiers.legacy.rubrics.rubric",
)
_SIGNATURES: dict[tuple[Any, bool], tuple[bool, frozenset[str]]] = {}


def accepted_names(func: Any) -> tuple[bool, frozenset[str]]:
    """(whether ``func`` takes ``**kwargs``, the names of its parameters), as ``inspect.signature`` says, read once
    per plain or bound function (keyed by the function and whether it is bound: a bound method's signature
    depends only on its function); other callables are read every time."""
    bound = inspect.ismethod(func)
    target = func.__func__ if bound else func
    key = (target, bound) if isinstance(target, types.FunctionType) else None
    if key is not None:
        found = _SIGNATURES.get(key)
        if found is not None:
            return found
    parameters = inspect.signature(func).parameters
    found = (any(p.kind == p.VAR_KEYWORD for p in parameters.values()), frozenset(parameters))
    if key is not None and len(_SIGNATURES) < SIGNATURE_CACHE_SIZE:
        _SIGNATURES[key] = found
    return found


async def maybe_call_with_named_args(func: Any, **objects: Any) -> Any:
    """verifiers' ``maybe_call_with_named_args`` (call ``func`` with the ``objects`` it names, all of them if it
    takes ``**kwargs``; await the result if it is awaitable) with the signature read once per function
    (`accepted_names`). verifiers calls it for every stop condition on every turn of every rollout (and for
    cleanup handlers): ``inspect.signature`` was ~15% of the env worker's CPU per rollout on the reverse-text
    task (cProfile, the worker against a local stub server)."""
    takes_all, names = accepted_names(func)
    result = func(**objects) if takes_all else func(**{k: v for k, v in objects.items() if k in names})
    if inspect.isawaitable(result):
        return await result
    return result


def install_named_args_cache() -> None:
    """Point verifiers' callers of ``maybe_call_with_named_args`` at `maybe_call_with_named_args` above, where
    they still hold verifiers' own function (an upgraded verifiers that changed it is left alone)."""
    try:
        modules = [importlib.import_module(name) for name in _NAMED_ARGS_CALLERS]
    except ImportError:
        return
    original = getattr(modules[0], "maybe_call_with_named_args", None)
    if original is None or original is maybe_call_with_named_args:
        return
    for module in modules:
        if getattr(module, "maybe_call_with_named_args", None) is original:
            module.maybe_call_with_named_args = maybe_call_with_named_args
