"""Reading and validating training_jsonl files.

One conversation a line: `{"id": ..., "conversations": [{"role": ..., "content": ...}, ...]}`; the
key `messages` is accepted in place of `conversations`. `id` is optional (default `line-<n>`) but
must be unique. Each malformed line raises `SampleError` with a short `code` (for the summary
counts) and a message saying what is wrong; a line that is not UTF-8 is one malformed line, the
others are read.

A record without an assistant turn is a prompt (for regeneration, which appends the target's reply,
and for evaluation); training needs a reply (`parse_sample(..., require_reply=True)`).

An assistant turn may carry `token_ids`: the exact token ids the target generated for that reply
(regeneration by a local target writes them; the end-of-turn token is not included). Training uses
them in place of re-tokenising the reply's text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant")


class SampleError(ValueError):
    """A sample that cannot be used; `code` groups the reasons in the summary."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # pickled whole, from a worker process of prepare_dataset(num_proc=...)
        return SampleError, (self.code, str(self))


@dataclass(frozen=True)
class Sample:
    line_number: int  # 1-based line in the source file
    id: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class UndecodableLine:
    """A line that is not valid UTF-8, for parse_sample to report: where its first bad byte is."""

    byte_offset: int  # in the file
    column: int  # 1-based byte of the line
    reason: str


def iter_lines(path: str | Path) -> Iterator[tuple[int, str | UndecodableLine]]:
    """(1-based line number, text) for every non-blank line; a line that is not valid UTF-8 comes
    as an UndecodableLine (parse_sample raises its SampleError), so one bad byte costs one line."""
    offset = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield line_number, UndecodableLine(offset + error.start, error.start + 1, error.reason)
            else:
                if line_number == 1:
                    line = line.removeprefix("\ufeff")  # a byte order mark, as some editors write
                if line.strip():
                    yield line_number, line
            offset += len(raw)


MAX_TOKEN_ID = 2**31  # exclusive: a dataset stores token ids as int32


def parse_sample(line: str | UndecodableLine, line_number: int, require_reply: bool = False) -> Sample:
    """Parse and validate one training_jsonl line; raises SampleError. `require_reply`: a record
    without an assistant turn (a prompt) is an error (training)."""
    if isinstance(line, UndecodableLine):
        raise SampleError(
            "invalid_utf8",
            f"not valid UTF-8 at byte offset {line.byte_offset} (column {line.column}: {line.reason}); "
            "re-encode the file as UTF-8",
        )
    try:
        record = json.loads(line.rstrip("\r\n"))  # without its end of line, a cut line's column is right
    except json.JSONDecodeError as e:
        raise SampleError("invalid_json", f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise SampleError("not_an_object", f"expected a JSON object, got {type(record).__name__}")
    messages = _messages_of(record)
    for turn_number, turn in enumerate(messages, start=1):
        _check_turn(turn, turn_number)
    if not any(turn["role"] == "assistant" for turn in messages):
        if require_reply:
            raise SampleError("no_assistant_turn", "no assistant turn (nothing to train on)")
        if messages[-1]["role"] != "user":
            raise SampleError("no_user_turn", "no assistant turn and no user turn last: nothing to answer")
    sample_id = record.get("id", f"line-{line_number}")
    if not isinstance(sample_id, (str, int)) or isinstance(sample_id, bool):
        raise SampleError("bad_id", f"'id' must be a string or an integer, got {type(sample_id).__name__}")
    if isinstance(sample_id, str):
        _check_unicode(sample_id, "'id'")
    messages = [_kept_fields(turn) for turn in messages]
    return Sample(line_number=line_number, id=str(sample_id), messages=messages)


def prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The turns before the first assistant reply (all of them in a prompt-only record): the prompt a
    server receives, as role and content. SampleError when the conversation starts with a reply."""
    roles = [turn["role"] for turn in messages]
    first_reply = roles.index("assistant") if "assistant" in roles else len(messages)
    if first_reply == 0:
        raise SampleError(
            "no_prompt",
            "the conversation starts with an assistant turn, so it has no prompt; put a user turn first",
        )
    return [{"role": turn["role"], "content": turn["content"]} for turn in messages[:first_reply]]


def _kept_fields(turn: dict) -> dict:
    kept = {"role": turn["role"], "content": turn["content"]}
    if "token_ids" in turn:
        kept["token_ids"] = turn["token_ids"]
    if turn.get("finish_reason") == "length":
        kept["finish_reason"] = "length"
    return kept


def _messages_of(record: dict) -> list:
    keys = [key for key in ("conversations", "messages") if key in record]
    if not keys:
        raise SampleError("missing_conversations", "missing 'conversations' (or 'messages') list")
    if len(keys) == 2:
        raise SampleError("both_keys", "has both 'conversations' and 'messages'; keep only one")
    messages = record[keys[0]]
    if not isinstance(messages, list) or not messages:
        raise SampleError("empty_conversations", f"'{keys[0]}' must be a non-empty list of turns")
    return messages


def _check_turn(turn: object, turn_number: int) -> None:
    where = f"turn {turn_number}"
    if not isinstance(turn, dict):
        raise SampleError("bad_turn", f"{where} is not an object with 'role' and 'content'")
    if "role" not in turn:
        raise SampleError("missing_role", f"{where} has no 'role'")
    if turn["role"] not in ROLES:
        raise SampleError(
            "unknown_role", f"{where} has unknown role {turn['role']!r} (expected one of {ROLES})"
        )
    if "content" not in turn:
        raise SampleError("missing_content", f"{where} ({turn['role']}) has no 'content'")
    content = turn["content"]
    if not isinstance(content, str):
        raise SampleError(
            "non_string_content",
            f"{where} ({turn['role']}) content must be a string, got {type(content).__name__}",
        )
    if not content.strip():
        raise SampleError("empty_content", f"{where} ({turn['role']}) has empty content")
    _check_unicode(content, f"{where} ({turn['role']}) content")
    if "token_ids" in turn:
        _check_token_ids(turn, where)
    if "finish_reason" in turn and (
        turn["role"] != "assistant" or not isinstance(turn["finish_reason"], str)
    ):
        raise SampleError(
            "bad_finish_reason",
            f"{where} ({turn['role']}): 'finish_reason' is why a reply ended (\"length\": cut at the length "
            "limit), a string on assistant turns only",
        )


def _check_unicode(text: str, what: str) -> None:
    """JSON's \\u escapes can spell a lone UTF-16 surrogate, which no tokenizer or file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = f"\\u{ord(text[error.start]):04x}"
        raise SampleError(
            "invalid_utf8",
            f"{what} holds an unpaired surrogate {bad} at character {error.start}; fix the text",
        ) from None


def _check_token_ids(turn: dict, where: str) -> None:
    token_ids = turn["token_ids"]
    if turn["role"] != "assistant":
        raise SampleError(
            "bad_token_ids", f"{where} ({turn['role']}) has 'token_ids'; only replies carry them"
        )
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in token_ids
    ):
        raise SampleError(
            "bad_token_ids",
            f"{where} (assistant): 'token_ids' must be a list of integer token ids in [0, 2^31); "
            "regenerate the file or remove the field",
        )
    if not token_ids:
        raise SampleError("bad_token_ids", f"{where} (assistant): 'token_ids' is empty but the reply is not")
