"""The tokenizer's chat template as ids around user / assistant turns (training rows are built as ids)."""
from __future__ import annotations

_S = "\uE000S{}\uE000"  # placeholder contents (private-use characters: never in a real template)


class ChatMarkup:
    """The template's markup as ids around user / assistant turns, rendered once with placeholder contents."""

    def __init__(self, tok):
        if not getattr(tok, "chat_template", None):
            raise ValueError("the tokenizer has no chat template: retrieval-data needs an instruct model's tokenizer")
        msgs = [{"role": "user", "content": _S.format(0)}, {"role": "assistant", "content": _S.format(1)},
                {"role": "user", "content": _S.format(2)}, {"role": "assistant", "content": _S.format(3)}]
        text = tok.apply_chat_template(msgs, tokenize=False)
        parts, rest = [], text
        for i in range(4):
            if rest.count(_S.format(i)) != 1:
                raise ValueError("the chat template does not render message contents verbatim")
            head, rest = rest.split(_S.format(i))
            parts.append(head)
        ids = lambda s: list(tok(s, add_special_tokens=False)["input_ids"]) if s else []  # noqa: E731
        # head: (system +) user start; to_assistant: user end + assistant start; to_user: assistant end + user start
        self.head, self.to_assistant, self.to_user, self.end = ids(parts[0]), ids(parts[1]), ids(parts[2]), ids(rest)
        if parts[3] != parts[1]:
            raise ValueError("the chat template renders the second user turn's end unlike the first")
        self.eot = self.end[:1]  # the end-of-turn token the model must learn to emit (trained after each reply)
        if self.to_user[:1] != self.eot:
            raise ValueError("the chat template ends an assistant turn differently before a user turn")


__all__ = ["ChatMarkup"]
