"""Regenerate assistant turns with the target's own greedy (temperature 0) replies.

Each assistant turn is replaced, turn by turn, by what the target answers given the already
regenerated history; system and user turns are kept; a prompt-only record (no assistant turn) gets
the target's reply appended. A local target's reply also keeps the exact ids it generated
(`token_ids`, without the stop token), which training uses instead of re-tokenising the text.
With `record_layer_ids` it also keeps the run's features of the conversation it completes (the
target's layer outputs from the generation's own forwards, `dflash2.target.recorded_generate`),
which `regenerate_file` hands to a `FeatureSink` (`dflash2.capture.fused` stages them to disk).
Two generators:
- `LocalTargetGenerator`: a Hugging Face causal LM, batched, left-padded `generate`.
- `ServerGenerator`: an OpenAI-compatible `/v1/chat/completions` server (SGLang, vLLM).

`regenerate_file` appends one complete JSON line per finished conversation and flushes it, so a
crash loses at most the conversations in flight; a rerun truncates a partial last line and skips
ids already in the output.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from dflash2.data.jsonl import Sample, SampleError, iter_lines, parse_sample, prompt_turns
from dflash2.data.render import encode_prompt, render_text, render_with_token_ids, stop_token_ids
from dflash2.errors import ReportedError
from dflash2.target.cache import new_cache
from dflash2.target.recorded_generate import check_full_attention, generate_recording

logger = logging.getLogger(__name__)
REFUSED = "refused"  # the key of a turn the server refused, in memory only
RETRIES = 5  # of a request the server answered busy or failing: after 1 + 2 + 4 + 8 + 16 s
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Reply:
    text: str  # without the end-of-turn marker
    token_ids: list[int] | None = (
        None  # the ids the target generated for `text`; None when unknown (a server)
    )
    # with record_layer_ids: the rendered conversation (history and this reply) and its features
    # [len(feature_ids), (K+1)*H]; None when not recorded
    feature_ids: list[int] | None = None
    features: torch.Tensor | None = None
    # the reply reached the length limit before an end-of-turn token: the target would have gone on
    cut: bool = False
    # why the server refused this history (an HTTP 4xx: a prompt longer than its context, say); the
    # conversation is then reported and not written
    refused: str | None = None


class ReplyGenerator(Protocol):
    def generate(self, histories: Sequence[Messages]) -> list[Reply | str]:
        """The next assistant reply for each history (a plain str: its text, ids unknown)."""
        ...


class FeatureSink(Protocol):
    def add(self, ids: list[str], replies: list[Reply | str]) -> None:
        """Keep the features of the finished conversations `ids` (each one's last reply); called
        before their lines are written, so a line on disk always has its features staged."""
        ...


class LocalTargetGenerator:
    """Greedy replies from a local Hugging Face target, one left-padded batch per call; with
    `record_layer_ids`, each reply also carries the features of its conversation at those layers."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_new_tokens: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        record_layer_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.stop_ids = set(stop_token_ids(tokenizer, model))
        self.record_layer_ids = None if record_layer_ids is None else list(record_layer_ids)
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad_token; set one (e.g. its eos token) before batched generation"
            )
        if self.record_layer_ids is not None:
            check_full_attention(model)

    def check_prompt(self, history: Messages) -> None:
        """SampleError when the chat template refuses `history` as a prompt, found before any
        generation so that one such conversation is reported by its line, not fail its batch."""
        render_text(history, self.tokenizer, self.chat_template_kwargs, add_generation_prompt=True)

    @torch.no_grad()
    def generate(self, histories: Sequence[Messages]) -> list[Reply]:
        prompts = [encode_prompt(history, self.tokenizer, self.chat_template_kwargs) for history in histories]
        input_ids, attention_mask = _left_pad(prompts, self.tokenizer.pad_token_id)
        settings = dict(
            do_sample=False,
            max_new_tokens=self.max_new_tokens,
            eos_token_id=sorted(self.stop_ids),
            # room for the new tokens: no step copies the whole cache (dflash2.target.cache)
            cache=new_cache(self.model, room=self.max_new_tokens),
        )
        if self.record_layer_ids is not None:
            return self._generate_recording(histories, input_ids, attention_mask, settings)
        device = next(self.model.parameters()).device
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            pad_token_id=self.tokenizer.pad_token_id,
            **settings,
        )
        return [self._reply(row) for row in output[:, input_ids.shape[1] :].tolist()]

    def _generate_recording(self, histories, input_ids, attention_mask, settings) -> list[Reply]:
        recorded = generate_recording(
            self.model,
            self.record_layer_ids,
            input_ids,
            attention_mask,
            self.tokenizer.pad_token_id,
            **settings,
        )
        replies = [self._reply(row) for row in recorded.generated.tolist()]
        conversations = []
        for history, reply in zip(histories, replies):
            turn = {"role": "assistant", "content": reply.text, "token_ids": reply.token_ids}
            try:
                ids = render_with_token_ids(
                    [*history, turn], self.tokenizer, self.chat_template_kwargs
                ).input_ids
            except SampleError:  # not renderable as training renders it: the finish captures it
                ids = None
            conversations.append(ids)
        features = recorded.features(conversations)
        return [
            replace(reply, feature_ids=ids, features=feats)
            for reply, ids, feats in zip(replies, conversations, features)
        ]

    def _reply(self, new_ids: list[int]) -> Reply:
        """The ids up to (not including) the first stop token, and their text; `cut` without one."""
        end = next((i for i, token in enumerate(new_ids) if token in self.stop_ids), None)
        ids = new_ids if end is None else new_ids[:end]
        return Reply(self.tokenizer.decode(ids, skip_special_tokens=False), ids, cut=end is None)


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(prompt) for prompt in prompts)
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, length - len(prompt) :] = 1
    return input_ids, attention_mask


class ServerGenerator:
    """Greedy replies from an OpenAI-compatible chat-completions server, `concurrency` requests at a time.

    `server_url` is the server root (`http://host:port`) or its `/v1` base. `chat_template_kwargs` is
    sent as the request field of that name (SGLang and vLLM pass it to the chat template).
    """

    def __init__(
        self,
        server_url: str,
        model: str,
        max_new_tokens: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        concurrency: int = 8,
        timeout_s: float = 600.0,
    ):
        base = server_url.rstrip("/")
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.chat_template_kwargs = chat_template_kwargs
        self.concurrency = concurrency
        self.timeout_s = timeout_s

    def generate(self, histories: Sequence[Messages]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._complete, histories))

    def _complete(self, history: Messages) -> Reply:
        """One reply; a busy or failing server (HTTP 408, 429, 5xx, a timeout) is asked again after
        1, 2, 4, ... s, RETRIES times, before the run stops with its last answer."""
        for attempt in range(RETRIES + 1):
            try:
                return self._request(history)
            except _Transient as error:
                if attempt == RETRIES:
                    raise ReportedError(
                        f"{self.url}: {error} (asked {RETRIES + 1} times); the finished conversations are "
                        "written: rerun the same command to resume"
                    ) from None
                logger.warning("%s: %s; asking again in %d s", self.url, error, 2**attempt)
                time.sleep(2**attempt)
        raise AssertionError("unreachable")

    def _request(self, history: Messages) -> Reply:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": history,
            "temperature": 0.0,
            "max_tokens": self.max_new_tokens,
        }
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            if error.code in (408, 429) or error.code >= 500:
                raise _Transient(f"HTTP {error.code}: {detail}") from None
            return Reply("", refused=f"HTTP {error.code}: {detail}")
        except urllib.error.URLError as error:
            if isinstance(error.reason, (TimeoutError, ConnectionResetError)):
                raise _Transient(str(error.reason) or type(error.reason).__name__) from None
            raise ValueError(f"cannot reach {self.url} ({error.reason}); check --server-url") from None
        except (TimeoutError, ConnectionResetError) as error:  # raised while reading the answer
            raise _Transient(f"no answer within {self.timeout_s:g} s ({type(error).__name__})") from None
        try:
            answer = json.loads(raw)
            choice = answer["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ReportedError(
                f"{self.url} answered what is not an OpenAI chat completion: {raw[:300]!r}; is --server-url "
                "the server's root (or its /v1)?"
            ) from None
        if message.get("reasoning_content"):
            raise ValueError(
                "the server split the reply into reasoning_content and content; start it without a reasoning "
                "parser so that the reply text (thinking included) comes back verbatim"
            )
        return Reply(message["content"] or "", cut=choice.get("finish_reason") == "length")


class _Transient(Exception):
    """A server answer worth asking again (busy, failing, too slow)."""


def regenerate_conversations(conversations: Sequence[Messages], generator: ReplyGenerator) -> list[Messages]:
    """Replace every assistant turn, turn by turn, conditioning each on the regenerated history.

    Conversations advance in lockstep: one `generator.generate` call per assistant-turn index. A
    conversation without an assistant turn (a prompt) gets one reply appended. A reply's
    `token_ids` are kept in its turn; the generator sees the history as role and content only.
    """
    return _regenerate(conversations, generator)[0]


def _regenerate(
    conversations: Sequence[Messages], generator: ReplyGenerator
) -> tuple[list[Messages], list[Reply | str]]:
    """regenerate_conversations, and each conversation's last reply as the generator gave it."""
    conversations = [
        c if any(t["role"] == "assistant" for t in c) else [*c, {"role": "assistant"}] for c in conversations
    ]
    results: list[Messages] = [[] for _ in conversations]
    last_replies: list[Reply | str] = [""] * len(conversations)
    positions = [0] * len(conversations)
    while True:
        waiting = []  # conversations whose next turn is an assistant turn
        for i, conversation in enumerate(conversations):
            while positions[i] < len(conversation) and conversation[positions[i]]["role"] != "assistant":
                results[i].append(dict(conversation[positions[i]]))
                positions[i] += 1
            if positions[i] < len(conversation):
                waiting.append(i)
        if not waiting:
            return results, last_replies
        histories = [[{"role": t["role"], "content": t["content"]} for t in results[i]] for i in waiting]
        for i, reply in zip(waiting, generator.generate(histories), strict=True):
            results[i].append(_reply_turn(reply))
            last_replies[i] = reply
            positions[i] += 1


def _reply_turn(reply: Reply | str) -> dict:
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    turn = {"role": "assistant", "content": reply.text}
    if reply.token_ids is not None:
        turn["token_ids"] = list(reply.token_ids)
    if reply.cut:  # as an OpenAI server says it; training then supervises no end-of-turn token there
        turn["finish_reason"] = "length"
    if reply.refused:  # reported and not written (regenerate_file)
        turn[REFUSED] = reply.refused
    return turn


def regenerate_file(
    input_path: str | Path,
    output_path: str | Path,
    generator: ReplyGenerator,
    batch_size: int = 8,
    on_error: str = "skip",
    feature_sink: FeatureSink | None = None,
) -> dict[str, int]:
    """Regenerate a training_jsonl file into `output_path`, resuming from what is already there
    (`feature_sink`: given each batch's last replies before their lines are written).

    Returns counts: `num_done_before` (skipped, already in the output), `num_written`,
    `num_invalid` (input lines skipped: malformed, no prompt, refused by the chat template, or an id
    already on an earlier line), `num_empty_replies` and `num_refused` (conversations not written,
    reported by id: a reply came back empty, or the server refused a history; with `on_error="fail"`
    either stops the run), `num_cut_replies`.
    """
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    done = finished_ids(output_path)
    samples, num_invalid = _pending_samples(
        input_path, done, on_error, getattr(generator, "check_prompt", None)
    )
    # Batches of similar lengths: a left-padded batch prefills every row to its longest prompt (on
    # the demo's 512 real prompts, batches of 32 in file order pad 100k prompt tokens to 240k; sorted,
    # to 112k). Records are written in this order; their ids say which is which.
    samples.sort(key=_length_hint)
    counts = {
        "num_done_before": len(done),
        "num_written": 0,
        "num_invalid": num_invalid,
        "num_empty_replies": 0,  # conversations not written: a reply came back empty
        "num_refused": 0,  # conversations not written: the server refused a history
        "num_cut_replies": 0,  # replies cut at the length limit (written, marked finish_reason "length")
    }
    with open(output_path, "a", encoding="utf-8") as out:
        for first in range(0, len(samples), batch_size):
            batch = samples[first : first + batch_size]
            conversations, last_replies = _regenerate([s.messages for s in batch], generator)
            kept = [i for i, c in enumerate(conversations) if _writable(batch[i], c, counts, on_error)]
            if feature_sink is not None:
                feature_sink.add([batch[i].id for i in kept], [last_replies[i] for i in kept])
            for sample, conversation in ((batch[i], conversations[i]) for i in kept):
                out.write(
                    json.dumps({"id": sample.id, "conversations": conversation}, ensure_ascii=False) + "\n"
                )
                out.flush()
                counts["num_written"] += 1
            os.fsync(out.fileno())
            logger.info("regenerated %d / %d", first + len(batch), len(samples))
    return counts


def _writable(sample: Sample, conversation: Messages, counts: dict[str, int], on_error: str) -> bool:
    """Whether a regenerated conversation is written; one the server refused or with an empty reply
    (which training refuses) is reported by its id, counted, and not written (a rerun asks again)."""
    replies = [turn for turn in conversation if turn["role"] == "assistant"]
    counts["num_cut_replies"] += sum(turn.get("finish_reason") == "length" for turn in replies)
    refused = next((turn[REFUSED] for turn in replies if REFUSED in turn), None)
    empty = not refused and any(not turn["content"].strip() for turn in replies)
    if not (refused or empty):
        return True
    key = "num_refused" if refused else "num_empty_replies"
    counts[key] += 1
    reason = f"the server refused it: {refused}" if refused else "an empty reply, which training refuses"
    if on_error == "fail":
        raise ValueError(f"id {sample.id!r} (line {sample.line_number}): {reason}")
    logger.warning("id %r (line %d): %s; not written", sample.id, sample.line_number, reason)
    return False


def _length_hint(sample: Sample) -> int:
    """Characters of a sample's turns other than the assistant's (which are regenerated): the order of
    its prompt lengths in tokens, without a tokenizer (a server generator has none)."""
    return sum(len(turn.get("content") or "") for turn in sample.messages if turn["role"] != "assistant")


def _pending_samples(
    input_path: str | Path, done: set[str], on_error: str, check_prompt: Any = None
) -> tuple[list[Sample], int]:
    """The input's samples not in `done`, and the number of invalid lines: malformed, a reply with no
    prompt before it, a prompt the chat template refuses (`check_prompt`, a local target's), or an
    id already on an earlier line. Each is reported by its line (skipped, or the error with
    `on_error="fail"`), so that no batch fails on one of them when it is generated."""
    samples, num_invalid = [], 0
    first_line: dict[str, int] = {}
    for line_number, line in iter_lines(input_path):
        try:
            sample = parse_sample(line, line_number)
            _check_prompts(sample, check_prompt)
            if sample.id in first_line:
                raise SampleError(
                    "duplicate_id",
                    f"id {sample.id!r} is also on line {first_line[sample.id]}; give each conversation its own id",
                )
        except SampleError as error:
            if on_error == "fail":
                raise ValueError(f"{input_path}:{line_number}: {error}") from None
            logger.warning("%s:%d: %s (skipped)", input_path, line_number, error)
            num_invalid += 1
            continue
        first_line[sample.id] = line_number
        if sample.id not in done:
            samples.append(sample)
    return samples, num_invalid


def _check_prompts(sample: Sample, check_prompt: Any) -> None:
    """Every prompt the regeneration will send for `sample` (the history before each assistant turn,
    or the whole record when it has none) has a user turn and, with `check_prompt`, renders."""
    prompt_turns(sample.messages)
    if check_prompt is None:
        return
    roles = [turn["role"] for turn in sample.messages]
    ends = [i for i, role in enumerate(roles) if role == "assistant"] or [len(roles)]
    for end in ends:
        check_prompt([{"role": t["role"], "content": t["content"]} for t in sample.messages[:end]])


def finished_ids(output_path: str | Path) -> set[str]:
    """Ids of the complete lines in `output_path`; a partial last line (a crash mid-write) is cut off."""
    path = Path(output_path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        logger.warning("%s: dropping a partial last line of %d bytes", path, len(data) - len(complete))
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    ids = set()
    # split on b"\n" only: str.splitlines also splits on U+2028, U+2029 and U+0085, which a reply may
    # hold and json.dumps(ensure_ascii=False) writes as they are
    for line_number, line in enumerate(complete.split(b"\n")[:-1], start=1):
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{path}:{line_number}: not a regenerated record; move the file away") from None
    return ids
