"""Regeneration: local target vs its own generate, an OpenAI-compatible server, crash and resume."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dflash2.data import regenerate as regenerate_module
from dflash2.data.regenerate import LocalTargetGenerator, ServerGenerator, regenerate_file
from dflash2.data.render import encode_prompt, render_text
from dflash2.errors import ReportedError
from tests.run_helpers import run_script_main


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _conversations(tiny_default, count: int) -> list[dict]:
    rows = [json.loads(line) for line in tiny_default.heldout_jsonl.read_text().splitlines()]
    multi_turn = [row for row in rows if sum(t["role"] == "assistant" for t in row["conversations"]) > 1]
    return (multi_turn[:1] + [row for row in rows if row not in multi_turn])[:count]


def test_local_regeneration_equals_target_greedy_generate(tiny_default, tiny_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir).eval()
    rows = _conversations(tiny_default, 5)
    assert sum(t["role"] == "assistant" for t in rows[0]["conversations"]) == 2
    generator = LocalTargetGenerator(model, tiny_tokenizer, max_new_tokens=24)
    output = tmp_path / "regen.jsonl"
    regenerate_file(_write_jsonl(tmp_path / "in.jsonl", rows), output, generator, batch_size=3)

    regenerated = {row["id"]: row for row in _read_jsonl(output)}  # written in order of prompt length
    assert sorted(regenerated) == sorted(row["id"] for row in rows)
    for original in rows:
        new = regenerated[original["id"]]
        assert [t["role"] for t in new["conversations"]] == [t["role"] for t in original["conversations"]]
        history = []
        for old_turn, new_turn in zip(original["conversations"], new["conversations"]):
            if old_turn["role"] != "assistant":
                assert new_turn == old_turn
            else:  # the reference: one unpadded greedy generate on the regenerated history
                assert new_turn["content"] == _greedy_reply(model, tiny_tokenizer, history, 24)
            history.append(new_turn)


def _greedy_reply(model, tokenizer, history, max_new_tokens) -> str:
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    new_ids = output[0, len(prompt_ids) :].tolist()
    if tokenizer.eos_token_id in new_ids:
        new_ids = new_ids[: new_ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(new_ids)


class _ChatServer(BaseHTTPRequestHandler):
    """Plays an OpenAI-compatible server: the reply names the turn and echoes the last user message."""

    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        assert self.path == "/v1/chat/completions", self.path
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        turn = sum(m["role"] == "assistant" for m in body["messages"]) + 1
        last = body["messages"][-1]["content"]
        reply = f"Reply {turn} to: {last}"
        answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
        if "cut me" in last:  # a reply that reached max_tokens
            answer["choices"][0]["finish_reason"] = "length"
        if "say nothing" in last:
            answer["choices"][0]["message"]["content"] = ""
        status, data = 200, json.dumps(answer).encode()
        if "too long" in last:  # what a server answers a prompt longer than its context
            status, data = 400, b'{"error": "the prompt is longer than the context"}'
        if "busy" in last and sum(last == r["messages"][-1]["content"] for r in self.requests) <= 2:
            status, data = 503, b'{"error": "overloaded"}'  # twice, then an answer
        if "garbage" in last:
            data = b"<html>Bad gateway</html>"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture()
def chat_server():
    _ChatServer.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ChatServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _ChatServer.requests
    server.shutdown()
    server.server_close()


def test_server_regeneration_writes_replies_turn_by_turn(chat_server, tmp_path, monkeypatch):
    url, requests = chat_server
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    old = {"role": "assistant", "content": "an old reply"}
    rows = [
        {"id": "a", "conversations": [{"role": "system", "content": "Be brief."}, user("hi"), old]},
        {"id": "b", "messages": [user("one"), old, user("two"), old]},
        {"id": "c", "messages": [user("please cut me"), old]},
    ]
    output = tmp_path / "out.jsonl"
    arguments = ["--input", str(_write_jsonl(tmp_path / "in.jsonl", rows)), "--out", str(output)]
    arguments += ["--server-url", url, "--model", "tiny", "--max-new-tokens", "32", "--batch-size", "2"]
    run_script_main(
        monkeypatch,
        "data_prep/regenerate.py",
        [*arguments, "--chat-template-kwargs", '{"enable_thinking": false}'],
    )

    assert sorted(_read_jsonl(output), key=lambda row: row["id"]) == [  # written shortest prompt first
        {"id": "a", "conversations": [rows[0]["conversations"][0], user("hi"), _assistant("Reply 1 to: hi")]},
        {
            "id": "b",
            "conversations": [
                user("one"),
                _assistant("Reply 1 to: one"),
                user("two"),
                _assistant("Reply 2 to: two"),
            ],
        },
        {
            "id": "c",
            "conversations": [
                user("please cut me"),
                {**_assistant("Reply 1 to: please cut me"), "finish_reason": "length"},
            ],
        },
    ]
    assert len(requests) == 4
    for request in requests:
        assert request["model"] == "tiny" and request["temperature"] == 0 and request["max_tokens"] == 32
        assert request["chat_template_kwargs"] == {"enable_thinking": False}
    second_turn = next(r for r in requests if len(r["messages"]) == 3)
    assert second_turn["messages"][1] == _assistant(
        "Reply 1 to: one"
    )  # conditioned on the regenerated history


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


class _FakeGenerator:
    """Deterministic replies; raises after `fail_after` calls to simulate a crash."""

    def __init__(self, fail_after: int | None = None):
        self.fail_after = fail_after
        self.num_calls = 0

    def generate(self, histories):
        self.num_calls += 1
        if self.fail_after is not None and self.num_calls > self.fail_after:
            raise RuntimeError("simulated crash")
        return [f"reply to {history[-1]['content']}" for history in histories]


def test_a_conversation_the_server_refuses_or_answers_empty_is_reported_and_the_rest_written(
    chat_server, tmp_path, caplog
):
    """One prompt a server refuses (HTTP 400) stopped every rerun at the same place; an empty reply
    was written, and training then refused the whole conversation."""
    url, _ = chat_server
    rows = [
        {"id": name, "conversations": [{"role": "user", "content": text}]}
        for name, text in (("a", "hi"), ("b", "this one is too long"), ("c", "say nothing"), ("d", "bye"))
    ]
    source, output = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    generator = ServerGenerator(url, "tiny", max_new_tokens=8)
    counts = regenerate_file(source, output, generator, batch_size=4)
    assert sorted(row["id"] for row in _read_jsonl(output)) == ["a", "d"]
    assert (counts["num_written"], counts["num_refused"], counts["num_empty_replies"]) == (2, 1, 1)
    assert "id 'b' (line 2): the server refused it: HTTP 400" in caplog.text
    assert "id 'c' (line 3): an empty reply, which training refuses; not written" in caplog.text
    # with on_error="fail", the first met (shortest prompt first) stops the run
    with pytest.raises(ValueError, match="id 'c' \\(line 3\\): an empty reply, which training refuses"):
        regenerate_file(source, tmp_path / "fail.jsonl", generator, batch_size=4, on_error="fail")


def test_a_busy_server_is_asked_again_and_a_garbled_answer_is_one_message(chat_server, tmp_path, monkeypatch):
    url, requests = chat_server
    monkeypatch.setattr(regenerate_module.time, "sleep", lambda s: None)
    generator = ServerGenerator(url, "tiny", max_new_tokens=8)
    busy = [{"role": "user", "content": "busy now"}]
    assert generator.generate([busy])[0].text == "Reply 1 to: busy now"
    assert len(requests) == 3  # two 503s, then the answer
    with pytest.raises(ReportedError, match="answered what is not an OpenAI chat completion: b'<html>"):
        generator.generate([[{"role": "user", "content": "garbage"}]])


def test_resume_after_crash_with_partial_line(tmp_path):
    rows = [
        {"id": f"s{i}", "conversations": [{"role": "user", "content": f"q{i}"}, _assistant("old")]}
        for i in range(10)
    ]
    source = _write_jsonl(tmp_path / "in.jsonl", rows)
    uninterrupted = tmp_path / "reference.jsonl"
    regenerate_file(source, uninterrupted, _FakeGenerator(), batch_size=3)

    output = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="simulated crash"):
        regenerate_file(source, output, _FakeGenerator(fail_after=2), batch_size=3)
    assert len(_read_jsonl(output)) == 6  # two finished batches survived the crash
    with open(output, "a") as f:
        f.write('{"id": "s6", "conversations": [{"ro')  # a line cut by the crash

    counts = regenerate_file(source, output, _FakeGenerator(), batch_size=3)
    assert counts["num_done_before"] == 6 and counts["num_written"] == 4
    assert output.read_text() == uninterrupted.read_text()  # no duplicate, nothing lost, same records

    assert regenerate_file(source, output, _FakeGenerator(fail_after=0), batch_size=3)["num_written"] == 0


class _RecordingGenerator(_FakeGenerator):
    def __init__(self):
        super().__init__()
        self.batches = []

    def generate(self, histories):
        self.batches.append([history[-1]["content"] for history in histories])
        return super().generate(histories)


def test_batches_hold_prompts_of_similar_length(tmp_path):
    lengths = [7, 1, 30, 4, 12, 2, 25, 9]
    rows = [
        {"id": f"s{i}", "conversations": [{"role": "user", "content": "x" * n}]}
        for i, n in enumerate(lengths)
    ]
    generator = _RecordingGenerator()
    output = tmp_path / "out.jsonl"
    regenerate_file(_write_jsonl(tmp_path / "in.jsonl", rows), output, generator, batch_size=3)
    assert [[len(prompt) for prompt in batch] for batch in generator.batches] == [
        [1, 2, 4],
        [7, 9, 12],
        [25, 30],
    ]
    written = _read_jsonl(output)
    assert [row["id"] for row in written] == ["s1", "s5", "s3", "s0", "s7", "s4", "s6", "s2"]
    assert all(
        row["conversations"][-1]["content"] == "reply to " + "x" * lengths[int(row["id"][1:])]
        for row in written
    )


class _SeparatorGenerator(_FakeGenerator):
    def generate(self, histories):  # replies holding the characters str.splitlines also splits on
        return [f"a\u2028b\u2029c\x85d {history[-1]['content']}" for history in histories]


def test_a_rerun_resumes_an_output_whose_replies_hold_unicode_line_separators(tmp_path):
    rows = [{"id": f"s{i}", "conversations": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]
    source, output = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert regenerate_file(source, output, _SeparatorGenerator(), batch_size=2)["num_written"] == 4
    assert "\u2028" in output.read_text()  # written as is (json.dumps with ensure_ascii=False)
    counts = regenerate_file(source, output, _SeparatorGenerator(), batch_size=2)
    assert counts["num_done_before"] == 4 and counts["num_written"] == 0


def test_corrupt_complete_line_in_output_is_an_error(tmp_path):
    source = _write_jsonl(
        tmp_path / "in.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "q"}, _assistant("r")]}]
    )
    output = tmp_path / "out.jsonl"
    output.write_text("not json\n")
    with pytest.raises(ValueError, match="out.jsonl:1: not a regenerated record"):
        regenerate_file(source, output, _FakeGenerator())


def test_stop_ids_are_what_the_server_stops_on(tiny_tokenizer):
    """The tokenizer's eos (<|im_end|> = 2 here), the target config's and generation config's eos
    ids (SGLang stops on all of them), and <|im_end|>; regeneration uses exactly these."""
    from types import SimpleNamespace

    from dflash2.data.render import stop_token_ids

    target = SimpleNamespace(
        config=SimpleNamespace(eos_token_id=0), generation_config=SimpleNamespace(eos_token_id=[2, 5])
    )
    assert stop_token_ids(tiny_tokenizer) == [2]
    assert stop_token_ids(tiny_tokenizer, target) == [0, 2, 5]
    assert LocalTargetGenerator(target, tiny_tokenizer, max_new_tokens=4).stop_ids == {0, 2, 5}


def test_local_regeneration_keeps_the_generated_ids_and_answers_prompt_only_records(
    tiny_default, tiny_tokenizer, tmp_path
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_default.target_dir).eval()
    rows = [
        {"id": row["id"], "conversations": row["conversations"][:1]}
        for row in _conversations(tiny_default, 4)[1:]
    ]
    assert all(row["conversations"][0]["role"] == "user" for row in rows)  # prompt-only records
    # a limit that the shortest greedy reply ends within and a longer one reaches (the tiny target is
    # trained on each machine, and its replies' lengths differ between machines)
    lengths = sorted(len(_greedy_ids(model, tiny_tokenizer, row["conversations"], 64)) for row in rows)
    assert lengths[0] < lengths[-1], lengths
    limit = lengths[0] + 1
    output = tmp_path / "regen.jsonl"
    regenerate_file(
        _write_jsonl(tmp_path / "in.jsonl", rows),
        output,
        LocalTargetGenerator(model, tiny_tokenizer, limit),
        2,
    )

    regenerated = {row["id"]: row for row in _read_jsonl(output)}  # written in order of prompt length
    assert sorted(regenerated) == sorted(row["id"] for row in rows)
    cut = []
    for row in rows:
        user, reply = regenerated[row["id"]]["conversations"]
        assert user == row["conversations"][0] and reply["role"] == "assistant"
        # Reference: one unpadded greedy generate, cut before the first stop token (eos = <|im_end|>).
        expected = _greedy_ids(model, tiny_tokenizer, [user], limit, keep_stop=True)
        cut.append(tiny_tokenizer.eos_token_id not in expected)
        if not cut[-1]:
            expected = expected[: expected.index(tiny_tokenizer.eos_token_id)]
        assert reply["token_ids"] == expected and reply["content"] == tiny_tokenizer.decode(expected)
        # a reply that reached the limit says so, as an OpenAI server would: no end-of-turn label
        assert reply.get("finish_reason") == ("length" if cut[-1] else None)
    assert any(cut) and not all(cut), cut  # both kinds of reply occurred


def _greedy_ids(model, tokenizer, history, max_new_tokens, keep_stop=False) -> list[int]:
    """One unpadded greedy generate after `history`'s generation prompt; cut before the first eos
    unless `keep_stop`."""
    prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        generated = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    ids = generated[0, len(prompt_ids) :].tolist()
    if keep_stop or tokenizer.eos_token_id not in ids:
        return ids
    return ids[: ids.index(tokenizer.eos_token_id)]


# a ChatML-like template that refuses roles that do not alternate, as many published templates do
_STRICT_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _TemplateGenerator(_FakeGenerator):
    """Renders every prompt with the chat template first, as LocalTargetGenerator does."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def check_prompt(self, history):
        render_text(history, self.tokenizer, add_generation_prompt=True)

    def generate(self, histories):
        for history in histories:
            encode_prompt(history, self.tokenizer)  # a refused prompt here failed the whole batch before
        return super().generate(histories)


def test_lines_no_batch_can_generate_are_reported_by_line_and_the_rest_regenerated(
    tiny_tokenizer, tmp_path, caplog
):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = _STRICT_TEMPLATE
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    rows = [
        {"id": "s0", "conversations": [user("q0"), _assistant("old")]},
        {"id": "s1", "conversations": [user("q1"), user("q1 again")]},  # refused by the template
        {"id": "s2", "conversations": [_assistant("hello"), user("q2")]},  # a reply with no prompt
        {"id": "s3", "conversations": [user("q3")]},
        {"id": "s0", "conversations": [user("another q0")]},  # the id of line 1 again
        {"id": "s5", "conversations": [user("q5"), _assistant("old"), user("q5b"), _assistant("old")]},
    ]
    source = _write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    with caplog.at_level("WARNING"):
        counts = regenerate_file(source, output, _TemplateGenerator(tokenizer), batch_size=8)
    assert counts["num_written"] == 3 and counts["num_invalid"] == 3
    written = {row["id"]: row["conversations"] for row in _read_jsonl(output)}
    assert sorted(written) == ["s0", "s3", "s5"]
    assert written["s0"][-1]["content"] == "reply to q0"  # the first line of the id, not the repeated one
    assert written["s5"][-1]["content"] == "reply to q5b"
    for line, reason in ((2, "roles must alternate"), (3, "no prompt"), (5, "also on line 1")):
        assert any(f"in.jsonl:{line}:" in r.message and reason in r.message for r in caplog.records), line
    with pytest.raises(ValueError, match=r"in\.jsonl:2: .*roles must alternate"):
        regenerate_file(source, tmp_path / "fail.jsonl", _TemplateGenerator(tokenizer), on_error="fail")
