"""ChatFormatter (incremental user turns match full renders) and parse_action."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_train.policy.chat import ChatFormatter, parse_action  # noqa: E402
from crl_train.policy.tiny import train_tiny_tokenizer  # noqa: E402

# A reduced Qwen3 template: strips past reasoning, reads enable_thinking.
QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return train_tiny_tokenizer(["go north", "you see a door", "<action>north</action>"], vocab_size=300)


def test_incremental_turns_equal_a_full_render(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chat = ChatFormatter(tokenizer)
    first = [{"role": "user", "content": "task: find the door"}]
    full = chat.render(first + [{"role": "assistant", "content": "<action>north</action>"},
                                {"role": "user", "content": "You see a door."}])
    incremental = (chat.render(first) + "<action>north</action>" + tokenizer.eos_token
                   + chat.user_turn_text("You see a door."))
    assert incremental == full
    # Without the EOS at the end of the response, the turn is closed by the user-turn text.
    assert chat.user_turn_text("x", after_eos=False).startswith(tokenizer.eos_token)
    ids = chat.user_turn_ids("You see a door.")
    assert tokenizer.decode(ids) == chat.user_turn_text("You see a door.")


def test_thinking_template_kwargs(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer = train_tiny_tokenizer(["a"], vocab_size=300)
    tokenizer.chat_template = QWEN3_LIKE
    off = ChatFormatter(tokenizer, {"enable_thinking": False})
    on = ChatFormatter(tokenizer, {"enable_thinking": True})
    msgs = [{"role": "user", "content": "hi"}]
    assert off.render(msgs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.render(msgs).endswith("<|im_start|>assistant\n")
    assert off.user_turn_text("obs") == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_bad_messages_and_templates(tokenizer) -> None:  # type: ignore[no-untyped-def]
    chat = ChatFormatter(tokenizer)
    with pytest.raises(ValueError, match="message 1"):
        chat.render([{"role": "user", "content": "a"}, {"content": "b"}])
    bare = train_tiny_tokenizer(["a"], vocab_size=300)
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        ChatFormatter(bare)


def test_parse_action() -> None:
    assert parse_action("Thought: go up.\n<action> north </action>") == "north"
    assert parse_action("<action>a</action> then <action>b</action>") == "b"  # the last one counts
    assert parse_action("<think><action>x</action></think>no action") is None  # drafts ignored
    assert parse_action("<action>multi\nline</action>") == "multi\nline"
    assert parse_action("Action: open door", r"Action:\s*(.+)") == "open door"
    assert parse_action("ACT[jump]", r"ACT\[\w+\]") == "ACT[jump]"  # no group: whole match
    assert parse_action("") is None
    with pytest.raises(ValueError, match="invalid pattern"):
        parse_action("x", "(")
