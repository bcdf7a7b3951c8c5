"""Render a conversation with the target's chat template and mark the assistant tokens.

The loss mask is found from the rendered text itself, so it works for any chat template (no
`{% generation %}` tags needed): each assistant reply is located in the rendered string, followed by
its end-of-turn marker (the tokenizer's eos token unless told otherwise); the tokens overlapping
those character spans get loss_mask 1, everything else (system, user, role headers, a thinking
prefix added by the template, the newline after the end-of-turn marker) gets 0.

A reply that carries `token_ids` (the exact ids the target generated) is placed as those ids: the
rendered text around it is tokenised piece by piece, so the prompt before the first reply is
exactly what `encode_prompt` gives, followed by the generated ids and the end-of-turn token.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from dflash2.data.jsonl import SampleError

IM_END = "<|im_end|>"  # the end-of-turn marker of ChatML templates (Qwen)


def render_text(
    messages: list[dict[str, str]],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The conversation as the chat template renders it; a conversation the template refuses (its
    `raise_exception`: roles that do not alternate, a system turn it does not support) is a
    SampleError, so that one such line is reported and skipped like any malformed line."""
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
    except TemplateError as error:
        raise SampleError("template_error", f"the chat template refuses this conversation: {error}") from None


def encode_prompt(
    messages: list[dict[str, str]], tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """The token ids a server feeds the target for `messages`: the chat template with the
    generation prompt (the assistant header) appended."""
    text = render_text(messages, tokenizer, chat_template_kwargs, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, target: Any = None) -> list[int]:
    """The ids that end a reply, decided as the server decides them: the tokenizer's eos, the eos ids
    of the target's config and generation config (SGLang stops on all of them), and <|im_end|> when
    the vocabulary has it. Regeneration, evaluation and the serving gate all stop on these."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    for config in (getattr(target, "config", None), getattr(target, "generation_config", None)):
        configured = getattr(config, "eos_token_id", None)
        ids.update(
            int(t) for t in (configured if isinstance(configured, list) else [configured]) if t is not None
        )
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if im_end is not None and im_end != tokenizer.unk_token_id:
        ids.add(int(im_end))
    if not ids:
        raise ValueError(
            f"no token ends a reply: the tokenizer has no eos token or {IM_END}, and the target's config and "
            "generation config name no eos_token_id; set eos_token_id in the target's generation_config.json"
        )
    return sorted(ids)


def cut_at_length(reply: dict) -> bool:
    """A reply that ended at the length limit (`finish_reason: "length"`, as regeneration and OpenAI
    servers say it): its end-of-turn marker is the template's, not the target's, so not a label."""
    return reply.get("finish_reason") == "length"


class Rendered(NamedTuple):
    """A conversation as training reads it: its ids and loss mask; whether the ids are the
    tokenisation of the rendered text (False: some reply's `token_ids` are not); and how many of its
    replies the template renders otherwise once a later turn follows them (`_rendered_replies`),
    kept as unsupervised context."""

    input_ids: list[int]
    loss_mask: list[int]
    matches_text: bool
    history_replies: int


def render_with_loss_mask(
    messages: list[dict[str, str]],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    end_of_turn: str | None = None,
) -> Rendered:
    """The whole rendered conversation, tokenised, with its loss mask; raises SampleError when a reply
    cannot be found verbatim (followed by its end-of-turn marker) in the text the template renders for
    it (`_rendered_replies`)."""
    end_of_turn = _end_of_turn(tokenizer, end_of_turn)
    text, reply_spans = _rendered_replies(messages, tokenizer, chat_template_kwargs, end_of_turn)
    spans = [  # a reply cut at the length limit: its end-of-turn marker is not the target's
        (start, content_end if cut_at_length(reply) else end)
        for reply, (start, content_end, end) in _supervised(messages, reply_spans)
    ]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = [int(_overlaps(token, spans)) for token in encoding["offset_mapping"]]
    return Rendered(list(encoding["input_ids"]), loss_mask, True, reply_spans.count(None))


def render_with_token_ids(
    messages: list[dict],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    end_of_turn: str | None = None,
) -> Rendered:
    """A conversation whose replies may carry `token_ids`, as training reads it.

    Without any `token_ids` this is render_with_loss_mask (matches_text True). Otherwise the text
    before, between and after the replies is tokenised piece by piece, each reply with ids is placed
    as its ids, and the reply's trailing whitespace and end-of-turn marker are tokenised from the
    text; loss_mask is 1 on each reply and its end-of-turn marker (not on the marker of a reply with
    `finish_reason: "length"`: cut at the length limit, the target did not end it there). matches_text says whether the
    result equals the tokenisation of the whole rendered text (False: the text does not re-tokenise
    to the target's ids). An id may lie past the tokenizer's last token (a target's vocabulary is
    often padded beyond it): the target emitted it, so it is the label.
    """
    if not any("token_ids" in message for message in messages):
        return render_with_loss_mask(messages, tokenizer, chat_template_kwargs, end_of_turn)
    end_of_turn = _end_of_turn(tokenizer, end_of_turn)
    text, reply_spans = _rendered_replies(messages, tokenizer, chat_template_kwargs, end_of_turn)
    replies = [message for message in messages if message["role"] == "assistant"]
    input_ids, loss_mask, cursor = [], [], 0
    for number, reply in enumerate(replies, start=1):
        if (
            "token_ids" in reply
            and tokenizer.decode(reply["token_ids"], skip_special_tokens=False) != reply["content"]
        ):
            raise SampleError(
                "token_ids_stale",
                f"reply {number}: its 'token_ids' do not decode to its content (the text was changed after "
                "the ids were generated, or the ids belong to another reply); regenerate it or remove 'token_ids'",
            )
    for reply, (start, content_end, end) in _supervised(messages, reply_spans):
        before = _encode(tokenizer, text[cursor:start])
        reply_ids = reply.get("token_ids") or _encode(tokenizer, text[start:content_end])
        closing = _encode(tokenizer, text[content_end:end])  # whitespace and the end-of-turn marker
        input_ids += before + reply_ids + closing
        loss_mask += [0] * len(before) + [1] * len(reply_ids) + [int(not cut_at_length(reply))] * len(closing)
        cursor = end
    after = _encode(tokenizer, text[cursor:])
    input_ids, loss_mask = input_ids + after, loss_mask + [0] * len(after)
    return Rendered(input_ids, loss_mask, input_ids == _encode(tokenizer, text), reply_spans.count(None))


def _rendered_replies(
    messages: list[dict], tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, end_of_turn: str
) -> tuple[str, list[tuple[int, int, int] | None]]:
    """The conversation's text and each reply's span in it (`_assistant_spans`).

    A reply the template renders otherwise once a later turn follows it (Qwen3's templates drop the
    thinking of replies before the last user turn) has no span (None): the target was given that
    rewritten history when it wrote the later replies, so it is context, unsupervised. Only such a
    reply, one found verbatim where the conversation ends with it, may lack a span; any other reply
    not found is a `template_mismatch`.

    When the conversation ends with a reply and the template puts text between the generation prompt
    and that reply (Qwen3's templates add an empty think block before a reply without `</think>`,
    such as a thinking reply cut at the length limit), the text before the reply is the generation
    prompt itself: what the target was given when it wrote the reply, and what a server gives it."""
    rendering = (tokenizer, chat_template_kwargs, end_of_turn)
    text = render_text(messages, tokenizer, chat_template_kwargs)
    spans = _assistant_spans(text, messages, end_of_turn)
    turns = [number for number, message in enumerate(messages, start=1) if message["role"] == "assistant"]
    for turn, span in zip(turns, spans):
        if span is None and (turn == len(messages) or not _verbatim_when_last(messages[:turn], *rendering)):
            raise SampleError(
                "template_mismatch",
                f"turn {turn} (assistant): reply followed by {end_of_turn!r} not found verbatim in the "
                "text rendered by the chat template (the template rewrites it, or its end-of-turn marker differs "
                "from the tokenizer's eos token: prepare the data with data_prep/prepare.py --end-of-turn <marker> "
                "and train on the directory it writes)",
            )
    if None in spans:
        _place_after_history(text, messages, turns, spans, rendering)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return text, spans
    start = spans[-1][0]
    prompt = render_text(messages[:-1], tokenizer, chat_template_kwargs, add_generation_prompt=True)
    if text[:start] == prompt or not text[:start].startswith(prompt):
        return text, spans
    shift = start - len(prompt)
    return prompt + text[start:], [*spans[:-1], tuple(position - shift for position in spans[-1])]


def _place_after_history(
    text: str, messages: list[dict], turns: list[int], spans: list, rendering: tuple
) -> None:
    """A reply after one the template rewrote lies past the turns before it (as far as the text
    renders them the same; without the generation prompt, which the history may render otherwise,
    e.g. Qwen3's empty think block with thinking off): one found before that was found inside the
    rewritten history, and is searched again from there (`spans` is updated); not found there, its
    sample is a template_mismatch."""
    tokenizer, chat_template_kwargs, end_of_turn = rendering
    first_history = turns[spans.index(None)]
    for i, (turn, span) in enumerate(zip(turns, spans)):
        if span is None or turn < first_history:
            continue
        before = render_text(messages[: turn - 1], tokenizer, chat_template_kwargs)
        bound = len(os.path.commonprefix([before, text]))
        if span[0] >= bound:
            continue
        content = _reply_text(messages[turn - 1])
        found = _find_reply(text, content, bound, end_of_turn)
        if found is None:
            raise SampleError(
                "template_mismatch",
                f"turn {turn} (assistant): reply followed by {end_of_turn!r} found only inside the history the "
                "chat template rewrote before it; give this turn as a conversation of its own, ending with it",
            )
        spans[i] = (found[0], found[0] + len(content), found[1])


def _verbatim_when_last(
    messages: list[dict], tokenizer: Any, chat_template_kwargs: dict[str, Any] | None, end_of_turn: str
) -> bool:
    """Whether the template renders the last reply of `messages` verbatim where nothing follows it."""
    text = render_text(messages, tokenizer, chat_template_kwargs)
    return _assistant_spans(text, messages, end_of_turn)[-1] is not None


def _supervised(messages: list[dict], spans: list) -> list[tuple[dict, tuple[int, int, int]]]:
    """(reply, span) of each reply that has a span: the replies the loss mask covers."""
    replies = [message for message in messages if message["role"] == "assistant"]
    return [(reply, span) for reply, span in zip(replies, spans) if span is not None]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _end_of_turn(tokenizer: Any, end_of_turn: str | None) -> str:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            "a fast (Rust-backed) tokenizer is required: load it with AutoTokenizer.from_pretrained"
        )
    end_of_turn = end_of_turn or tokenizer.eos_token
    if not end_of_turn:
        raise ValueError(
            "the tokenizer has no eos_token, which marks the end of a reply: prepare the data with "
            "data_prep/prepare.py --end-of-turn <marker> (e.g. '<|im_end|>') and train on the directory it writes"
        )
    return end_of_turn


def _assistant_spans(
    text: str, messages: list[dict[str, str]], end_of_turn: str
) -> list[tuple[int, int, int] | None]:
    """(start, content end, end) character positions of each assistant reply, None for a reply not
    found; [start, end) covers the reply plus its end-of-turn marker. A reply with `token_ids` is
    searched verbatim (its ids are the whole content), any other with surrounding whitespace stripped.

    Messages are searched in order from a moving cursor, so a reply is never matched inside an
    earlier turn (past a reply not found, the cursor moves past its turn's end-of-turn marker). A reply must be followed (after optional whitespace) by `end_of_turn`, which also
    keeps short replies from matching inside a role header.
    """
    spans = []
    cursor = 0
    for message in messages:
        content = _reply_text(message)
        if message["role"] != "assistant":
            found = text.find(content, cursor)
            cursor = found + len(content) if found >= 0 else cursor  # templates may rewrite these; harmless
            continue
        span = _find_reply(text, content, cursor, end_of_turn)
        spans.append(None if span is None else (span[0], span[0] + len(content), span[1]))
        cursor = _past_turn(text, cursor, end_of_turn) if span is None else span[1]
    return spans


def _reply_text(message: dict) -> str:
    """The text a turn is searched by: a reply with `token_ids` verbatim (its ids are the whole
    content), any other turn with surrounding whitespace stripped."""
    return message["content"] if "token_ids" in message else message["content"].strip()


def _past_turn(text: str, cursor: int, end_of_turn: str) -> int:
    """Where a reply not found (the template rewrote it) ends: past the first end-of-turn marker of
    its turn, the one closing the turn before it (right at `cursor`) not counted, so that the later
    turns are searched after it, never inside it."""
    start = cursor + len(text[cursor:]) - len(text[cursor:].lstrip())
    if text.startswith(end_of_turn, start):
        start += len(end_of_turn)
    end = text.find(end_of_turn, start)
    return len(text) if end < 0 else end + len(end_of_turn)


def _overlaps(token: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    token_start, token_end = token
    return any(token_start < span_end and token_end > span_start for span_start, span_end in spans)


def _find_reply(text: str, content: str, cursor: int, end_of_turn: str) -> tuple[int, int] | None:
    start = text.find(content, cursor)
    while start >= 0:
        after = start + len(content)
        gap = len(text[after:]) - len(text[after:].lstrip())
        if text.startswith(end_of_turn, after + gap):
            return start, after + gap + len(end_of_turn)
        start = text.find(content, start + 1)
    return None


def has_trainable_block(loss_mask: list[int]) -> bool:
    """True when two consecutive tokens are supervised (an anchor with something after it)."""
    return any(a and b for a, b in zip(loss_mask, loss_mask[1:]))
