"""Chat-template glue: prompt ids, the ids that append a user turn, and action parsing.

A multi-turn episode is built token by token (``TokenSequence``) rather than re-rendered each
turn, because templates rewrite history (Qwen3 drops past reasoning) and the trained tokens must
be exactly the sampled ones. :meth:`ChatFormatter.user_turn_ids` gives the ids to append after a
generated response: they close the assistant turn (unless the response already ended with the
EOS that closes it), open a user turn with the observation, and open the next assistant turn.

>>> parse_action("I should go up. <action>north</action>")
'north'
>>> parse_action("<think>maybe <action>west</action></think> <action> east </action>")
'east'
>>> parse_action("no tags") is None
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

# the one answer parser is the episode driver's; re-exported under its old place
from crl_gym.episode.answer import ACTION_PATTERN as ACTION_PATTERN
from crl_gym.episode.answer import parse_action as parse_action

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_USER_MARK = "\u2063USERMARK\u2063"  # invisible separators: never produced by a template
_ASSISTANT_MARK = "\u2063ASSISTANTMARK\u2063"


class ChatFormatter:
    """Renders messages with ``tokenizer``'s chat template (and extra template kwargs)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, chat_kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', tokenizer)!r} has no "
                "chat_template; use an instruct model or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.chat_kwargs = dict(chat_kwargs or {})
        self._turn_prefix, self._turn_suffix = self._user_turn_template()

    def render(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(
                    f"chat message {i} needs 'role' and 'content' keys, got {sorted(m)}"
                )
        return str(
            self.tokenizer.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.chat_kwargs,
            )
        )

    def encode(self, text: str) -> list[int]:
        """Ids of already-rendered text (special tokens are parsed, none are added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt))

    def _user_turn_template(self) -> tuple[str, str]:
        # Render a conversation whose assistant turn is followed by a user turn, then cut out the
        # text between the assistant content and the user content, and after the user content.
        msgs = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": _ASSISTANT_MARK},
            {"role": "user", "content": _USER_MARK},
        ]
        full = self.render(msgs, add_generation_prompt=True)
        if _ASSISTANT_MARK not in full or _USER_MARK not in full:
            raise ValueError("the chat template drops message contents; cannot build user turns")
        after_assistant = full.rsplit(_ASSISTANT_MARK, 1)[1]
        prefix, suffix = after_assistant.split(_USER_MARK, 1)
        return prefix, suffix

    def user_turn_text(self, text: str, *, after_eos: bool = True) -> str:
        """Text to append after a response: close the turn, a user turn with ``text``, the
        generation prompt. ``after_eos``: the response ended with the EOS that closes the turn."""
        prefix = self._turn_prefix
        eos = self.tokenizer.eos_token
        if after_eos and eos and prefix.startswith(eos):
            prefix = prefix[len(eos) :]
        return prefix + text + self._turn_suffix

    def user_turn_ids(self, text: str, *, after_eos: bool = True) -> list[int]:
        return self.encode(self.user_turn_text(text, after_eos=after_eos))
