"""A tokenizer read straight from a local model directory: ``tokenizer.json`` through the `tokenizers` library and
the chat template through jinja2, rendered the way transformers renders it (a sandboxed environment with
``trim_blocks``/``lstrip_blocks``, loop controls, the ``{% generation %}`` tag, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, the special tokens in the template's context).

The preflight measures prompts with it and the orchestrator decodes its sample rollouts with it, so neither imports
transformers for that (2.6 s of imports, torch among them, at a start-up that shares 2 cores with vLLM's import).
``FileTokenizer.load`` gives None where the files are not there (a hub id, a tokenizer without a
``tokenizer.json``): the caller then uses transformers' ``AutoTokenizer``.

    tokenizer = FileTokenizer.load("runs/demo/sft/weights/step_1000")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokenizer.decode([ids[0]])
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
"""The special tokens a chat template can name (transformers passes its special-tokens map to the template)."""


class FileTokenizer:
    def __init__(self, tokenizer: Any, chat_template: str | None, special_tokens: dict[str, str]) -> None:
        self._tokenizer = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.special_tokens = special_tokens
        self._template: Any = None

    @classmethod
    def load(cls, name: str | Path) -> FileTokenizer | None:
        """The tokenizer of the model directory ``name``; None when it has no ``tokenizer.json``."""
        directory = Path(name)
        if not (directory / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = directory / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else _config_template(config)
        special = {key: _token_text(config.get(key)) for key in SPECIAL_TOKENS}
        return cls(
            Tokenizer.from_file(str(directory / "tokenizer.json")),
            template,
            {key: text for key, text in special.items() if text is not None},
        )

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        """The conversation as text through the chat template (``tokenize`` must be False: count the tokens of
        the text with ``__call__(text, add_special_tokens=False)``, as transformers does)."""
        if tokenize:
            raise ValueError("FileTokenizer.apply_chat_template gives text; tokenize it with the tokenizer")
        if self.chat_template is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
                "argument was passed"
            )
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )


def _config_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training masks; rendering
        only needs its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(source)
