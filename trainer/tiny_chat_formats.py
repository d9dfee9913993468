"""The chat templates of the tiny model families (``primerl.trainer.tiny_families``): each written over the tiny
model's byte-level tokenizer, with the family's turn markers as special tokens added after its trained ones.
The shapes are the released models' (Llama 3 headers, Gemma turns, Mistral ``[INST]``, Phi-3 and Tulu roles,
Granite roles, gpt-oss's harmony without channels, ChatML) without their default system prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and the special tokens it needs beyond the trained tokenizer's three (ChatML's)."""

    name: str
    template: str
    eos_token: str
    """The end-of-turn token: the tokenizer's and the generation config's EOS."""
    added_tokens: tuple[str, ...] = ()
    bos_token: str | None = None


CHATML = ChatFormat(
    "chatml",
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    eos_token="<|im_end|>",
)
LLAMA3 = ChatFormat(
    "llama3",
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    eos_token="<|eot_id|>",
    added_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos_token="<|begin_of_text|>",
)
# Mistral and Gemma have no system role: a system message is put before the first user message.
_SYSTEM_FOLDED = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] + '\\n\\n' %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
)
MISTRAL = ChatFormat(
    "mistral",
    _SYSTEM_FOLDED + "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}",
    eos_token="</s>",
    added_tokens=("<s>", "</s>", "[INST]", "[/INST]"),
    bos_token="<s>",
)
GEMMA = ChatFormat(
    "gemma",
    _SYSTEM_FOLDED + "{{- bos_token }}{%- for message in messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] + "
    "'<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}",
    eos_token="<end_of_turn>",
    added_tokens=("<bos>", "<start_of_turn>", "<end_of_turn>"),
    bos_token="<bos>",
)
PHI3 = ChatFormat(
    "phi3",
    "{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}",
    eos_token="<|end|>",
    added_tokens=("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
)
TULU = ChatFormat(  # OLMo 2 Instruct
    "tulu",
    "{{- bos_token }}{%- for message in messages %}{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}",
    eos_token="<|endoftext|>",
    added_tokens=("<|system|>", "<|user|>", "<|assistant|>"),
    bos_token="<|endoftext|>",
)
GRANITE = ChatFormat(
    "granite",
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}",
    eos_token="<|end_of_text|>",
    added_tokens=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
)
HARMONY = ChatFormat(  # gpt-oss, without channels
    "harmony",
    "{%- for message in messages %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant<|message|>' }}{%- endif %}",
    eos_token="<|return|>",
    added_tokens=("<|start|>", "<|message|>", "<|end|>", "<|return|>"),
)
