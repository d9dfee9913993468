"""`runtime.tokenizer_files.FileTokenizer` against transformers' `AutoTokenizer` on the same model directory: the
same chat-template text, the same token ids, the same token texts (the preflight's prompt lengths and the sample
rollouts depend on them)."""

from __future__ import annotations

import json
import shutil

import pytest

from primerl.runtime.tokenizer_files import FileTokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "a b c"}],
    [{"role": "system", "content": "Reverse the letters."}, {"role": "user", "content": "x y z"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": 'yo <b>bold</b> & "quoted"'},
        {"role": "user", "content": "again: ünïcödé, 漢字, emoji 🙂"},
    ],
]


@pytest.fixture(scope="module")
def both(tiny_model):
    from transformers import AutoTokenizer

    return FileTokenizer.load(tiny_model), AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_text_and_ids_match_transformers(both, conversation, generation_prompt):
    files, reference = both
    text = files.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    assert text == reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
    assert files(text, add_special_tokens=False)["input_ids"] == reference(text, add_special_tokens=False)["input_ids"]


def test_plain_text_ids_and_token_texts_match_transformers(both):
    files, reference = both
    for text in ["plain text", "Ünïcode <|im_end|> then more", "  spaces\n\nand lines  "]:
        assert files(text)["input_ids"] == reference(text)["input_ids"]
    ids = reference("hello world<|im_end|> ü 漢")["input_ids"]
    assert [files.decode([i]) for i in ids] == [reference.decode([i]) for i in ids]
    assert files.decode(ids) == reference.decode(ids)


def test_the_template_from_tokenizer_config_and_what_transformers_adds_to_jinja(tiny_model, tmp_path):
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(tiny_model / "tokenizer.json", directory / "tokenizer.json")
    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{% generation %}{{ m.role }}: {{ m.content | tojson }}{% endgeneration %}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "</s>"}))
    tokenizer = FileTokenizer.load(directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "<a & b>"}], add_generation_prompt=True)
    assert text == 'user: "<a & b>"</s>\nassistant:'  # tojson does not escape HTML, as in transformers
    with pytest.raises(Exception, match="no tools here"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_tokenizer_json_or_no_template(tmp_path, tiny_model):
    assert FileTokenizer.load(tmp_path) is None  # the caller falls back to transformers
    assert FileTokenizer.load(tmp_path / "missing") is None
    shutil.copy(tiny_model / "tokenizer.json", tmp_path / "tokenizer.json")
    tokenizer = FileTokenizer.load(tmp_path)
    with pytest.raises(ValueError, match="chat_template is not set"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
