"""prepare_dataset: loss masks against an independent token-level check, malformed lines, drops."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from dflash2.data.prepare import load_prepared, prepare_dataset
from tests.run_helpers import REPO, run_script_main

USER = {"role": "user", "content": "Count from 3 to 9."}
REPLY = {"role": "assistant", "content": "Counting from 3 to 9: 3, 4, 5, 6, 7, 8, 9. That makes 7 numbers."}
VALID = {"id": "ok", "conversations": [USER, REPLY]}


def _ids(tokenizer, messages, add_generation_prompt=False, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def expected_loss_mask(tokenizer, messages, **kwargs) -> list[int]:
    """Each reply's tokens found by rendering the conversation with and without that reply.

    The reply tokens are what rendering with it adds after the generation prompt, up to and
    including the first eos (end-of-turn) token.
    """
    full = _ids(tokenizer, messages, **kwargs)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(tokenizer, messages[:i], add_generation_prompt=True, **kwargs)
        with_reply = _ids(tokenizer, messages[: i + 1], **kwargs)
        assert with_reply[: len(prompt)] == prompt and full[: len(with_reply)] == with_reply
        added = with_reply[len(prompt) :]
        num_reply_tokens = added.index(tokenizer.eos_token_id) + 1
        mask[len(prompt) : len(prompt) + num_reply_tokens] = [1] * num_reply_tokens
    return mask


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_loss_masks_match_independent_check(tiny_default, tiny_tokenizer):
    lines = tiny_default.train_jsonl.read_text().splitlines()[:60]
    dataset, summary = prepare_dataset(tiny_default.train_jsonl, tiny_tokenizer, max_length=4096)
    assert summary["num_dropped"] == 0 and summary["num_kept"] == summary["num_lines"] == len(dataset)
    num_multi_turn = 0
    for line, row in zip(lines, dataset):
        record = json.loads(line)
        assert row["id"] == record["id"]
        assert row["input_ids"] == _ids(tiny_tokenizer, record["conversations"])
        assert row["loss_mask"] == expected_loss_mask(tiny_tokenizer, record["conversations"])
        num_multi_turn += sum(m["role"] == "assistant" for m in record["conversations"]) > 1
    assert num_multi_turn > 0  # the check covered later turns too


THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_thinking_style_template_masks_only_the_reply(tiny_default, tiny_tokenizer, tmp_path):
    """A template that adds an empty think block to the generation prompt (as Qwen3 does with
    enable_thinking=False): the block belongs to the prompt, never to the supervised reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    system = {"role": "system", "content": "You are a helpful assistant."}
    path = _write_jsonl(tmp_path / "think.jsonl", [VALID, {"id": "sys", "messages": [system, USER, REPLY]}])
    kwargs = {"enable_thinking": False}
    dataset, summary = prepare_dataset(path, tokenizer, max_length=512, chat_template_kwargs=kwargs)
    assert summary["num_kept"] == 2
    for row, messages in zip(dataset, ([USER, REPLY], [system, USER, REPLY])):
        assert row["loss_mask"] == expected_loss_mask(tokenizer, messages, **kwargs)
        supervised = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert tokenizer.decode(supervised) == REPLY["content"] + "<|im_end|>"


def test_a_reply_after_a_think_block_the_template_adds_trains_after_its_generation_prompt(
    tiny_default, tmp_path
):
    """Qwen3's templates render a reply without `</think>` (a thinking reply cut at the length limit)
    after an empty think block that the generation prompt, what the target was given, lacks."""
    from transformers import AutoTokenizer

    from dflash2.data.render import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    kwargs = {"enable_thinking": True}
    content = "<think>\nThe user asks for a count. Let me"
    reply_ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    cut = {"role": "assistant", "content": content, "finish_reason": "length"}
    rows = [
        {"id": "text", "conversations": [USER, cut]},
        {"id": "ids", "conversations": [USER, {**cut, "token_ids": reply_ids}]},
    ]
    dataset, summary = prepare_dataset(
        _write_jsonl(tmp_path / "cut.jsonl", rows), tokenizer, 512, chat_template_kwargs=kwargs
    )
    prompt = encode_prompt([USER], tokenizer, kwargs)
    assert summary["num_kept"] == 2 and "</think>" not in tokenizer.decode(dataset[1]["input_ids"])
    ids, mask = dataset[1]["input_ids"], dataset[1]["loss_mask"]  # then the unsupervised end of turn
    assert ids[: len(prompt) + len(reply_ids)] == prompt + reply_ids  # before: the empty think block between
    assert mask == [0] * len(prompt) + [1] * len(reply_ids) + [0] * (len(ids) - len(prompt) - len(reply_ids))
    text_ids, text_mask = dataset[0]["input_ids"], dataset[0]["loss_mask"]
    assert tokenizer.decode(text_ids[: text_mask.index(1)]) == tokenizer.decode(prompt)
    assert tokenizer.decode([t for t, m in zip(text_ids, text_mask) if m]) == content


# A template that, as Qwen3's do, drops the thinking of the replies before the last user turn.
HISTORY_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FIRST = {
    "role": "assistant",
    "content": "<think>\nThey want seven numbers.\n</think>\n\n3, 4, 5, 6, 7, 8, 9.",
}
AGAIN = {"role": "user", "content": "And back?"}
SECOND = {"role": "assistant", "content": "<think>\nReverse it.\n</think>\n\n9, 8, 7, 6, 5, 4, 3."}


def test_an_earlier_reply_the_template_rewrites_is_context_and_the_later_one_trains(
    tiny_default, tiny_tokenizer, tmp_path
):
    """A thinking conversation of two turns: the first reply is rendered without its thinking once
    the second user turn follows it, which is what the target was given when it wrote the second
    reply; that context stays unsupervised and the second reply trains, with text or exact ids."""
    from transformers import AutoTokenizer

    from dflash2.data.render import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = HISTORY_TEMPLATE
    conversation = [USER, FIRST, AGAIN, SECOND]
    assert FIRST["content"] not in tokenizer.apply_chat_template(conversation, tokenize=False)  # the premise
    spelled = _spelled_out(tokenizer, SECOND["content"])
    with_ids = [USER, {**FIRST, "token_ids": _spelled_out(tokenizer, FIRST["content"])}, AGAIN]
    rows = [
        {"id": "text", "conversations": conversation},
        {"id": "ids", "conversations": [*with_ids, {**SECOND, "token_ids": spelled}]},
        {"id": "one", "conversations": [USER, FIRST]},
    ]
    dataset, summary = prepare_dataset(_write_jsonl(tmp_path / "turns.jsonl", rows), tokenizer, 512)

    # Reference: the prompt of the second turn, as the target was given it, then that reply's tokens.
    prompt = encode_prompt([USER, FIRST, AGAIN], tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    canonical = tokenizer(SECOND["content"], add_special_tokens=False)["input_ids"]
    for row, reply_ids in zip(dataset, (canonical, spelled)):
        assert row["input_ids"] == prompt + reply_ids + [im_end] + newline
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(reply_ids) + 1) + [0] * len(newline)
    assert dataset[0]["input_ids"] == _ids(tokenizer, conversation)
    assert dataset[2]["loss_mask"] == expected_loss_mask(tokenizer, [USER, FIRST])  # alone, it trains
    assert summary["num_kept"] == 3 and summary["num_dropped"] == 0
    assert summary["num_history_replies"] == 2 and summary["history_reply_lines"] == [1, 2]


def test_a_reply_after_a_rewritten_one_with_thinking_off_keeps_its_place(tiny_default, tmp_path):
    """With thinking off the generation prompt ends with an empty think block that the history does
    not render: a later reply starting like that block ('<') is still found where it is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = HISTORY_TEMPLATE.replace(
        "{{- '<|im_start|>assistant\\n' }}",
        "{{- '<|im_start|>assistant\\n' }}{%- if not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    )
    tagged = {"role": "assistant", "content": "<b>x</b>"}
    conversation = [USER, FIRST, AGAIN, tagged, {"role": "user", "content": "More?"}, SECOND]
    kwargs = {"enable_thinking": False}
    path = _write_jsonl(tmp_path / "off.jsonl", [{"id": "off", "conversations": conversation}])
    dataset, summary = prepare_dataset(path, tokenizer, 1024, chat_template_kwargs=kwargs)
    assert summary["num_kept"] == 1 and summary["num_history_replies"] == 1
    supervised = tokenizer.decode([t for t, m in zip(dataset[0]["input_ids"], dataset[0]["loss_mask"]) if m])
    assert supervised == "<b>x</b><|im_end|>" + SECOND["content"] + "<|im_end|>"


def test_later_turns_are_never_found_inside_a_rewritten_reply(tiny_default, tmp_path):
    """The rewritten first reply holds the text of both later turns; they are searched after it."""
    from transformers import AutoTokenizer

    from dflash2.data.render import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = HISTORY_TEMPLATE
    first = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nOK? Yes."}
    again, second = {"role": "user", "content": "OK?"}, {"role": "assistant", "content": "Yes."}
    rows = [{"id": "echo", "conversations": [USER, first, again, second]}]
    dataset, summary = prepare_dataset(_write_jsonl(tmp_path / "echo.jsonl", rows), tokenizer, 512)
    prompt = encode_prompt([USER, first, again], tokenizer)
    reply = tokenizer("Yes.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert dataset[0]["input_ids"][: len(prompt) + len(reply)] == prompt + reply
    assert dataset[0]["loss_mask"][: len(prompt) + len(reply)] == [0] * len(prompt) + [1] * len(reply)
    assert sum(dataset[0]["loss_mask"]) == len(reply) and summary["num_history_replies"] == 1
    # a template that writes more after a user turn's text than its end-of-turn marker: the later
    # turns are still placed past the prompt the target was given for the last reply
    tokenizer.chat_template = HISTORY_TEMPLATE.replace(
        "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}",
        "{{- '<|im_start|>' + m['role'] + '\\n' + content + ('\\n/think' if m['role'] == 'user' else '') + '<|im_end|>\\n' }}",
    )
    prompt = encode_prompt([USER, first, again], tokenizer)
    dataset, summary = prepare_dataset(_write_jsonl(tmp_path / "echo2.jsonl", rows), tokenizer, 512)
    assert "/think" in tokenizer.decode(prompt)  # the premise: the other template
    assert dataset[0]["input_ids"][: len(prompt) + len(reply)] == prompt + reply
    assert sum(dataset[0]["loss_mask"]) == len(reply) and dataset[0]["loss_mask"][len(prompt)] == 1


def test_a_reply_the_template_rewrites_even_last_is_a_template_mismatch(tiny_default, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_default.target_dir)
    tokenizer.chat_template = HISTORY_TEMPLATE.replace("loop.index0 < ns.last_user and ", "")
    rows = [
        {"id": "two", "conversations": [USER, FIRST, AGAIN, SECOND]},
        {"id": "one", "conversations": [USER, FIRST]},
    ]
    path = _write_jsonl(tmp_path / "rewritten.jsonl", [VALID, *rows])
    with caplog.at_level("WARNING"):
        _, summary = prepare_dataset(path, tokenizer, 512)
    assert summary["num_kept"] == 1 and summary["dropped_by_reason"] == {"template_mismatch": 2}
    assert summary["num_history_replies"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        f"{path}:{line}: turn {turn} (assistant): reply followed by '<|im_end|>' not found verbatim in the text "
        "rendered by the chat template (the template rewrites it, or its end-of-turn marker differs from the "
        "tokenizer's eos token: prepare the data with data_prep/prepare.py --end-of-turn <marker> and train on "
        "the directory it writes) (dropped)"
        for line, turn in ((2, 2), (3, 2))
    ]


MALFORMED = [
    ("{not json", "invalid_json", "invalid JSON"),
    ("[1, 2]", "not_an_object", "expected a JSON object"),
    ({"id": "x"}, "missing_conversations", "missing 'conversations'"),
    (
        {"conversations": [USER, REPLY], "messages": [USER, REPLY]},
        "both_keys",
        "both 'conversations' and 'messages'",
    ),
    ({"conversations": []}, "empty_conversations", "non-empty list"),
    ({"conversations": ["hello", REPLY]}, "bad_turn", "turn 1 is not an object"),
    ({"conversations": [{"content": "hi"}, REPLY]}, "missing_role", "turn 1 has no 'role'"),
    (
        {"conversations": [{"role": "bot", "content": "hi"}, REPLY]},
        "unknown_role",
        "turn 1 has unknown role 'bot'",
    ),
    (
        {"conversations": [USER, {"role": "assistant"}]},
        "missing_content",
        "turn 2 (assistant) has no 'content'",
    ),
    (
        {"conversations": [USER, {"role": "assistant", "content": 7}]},
        "non_string_content",
        "must be a string, got int",
    ),
    (
        {"conversations": [{"role": "user", "content": " \n"}, REPLY]},
        "empty_content",
        "turn 1 (user) has empty content",
    ),
    ({"conversations": [USER]}, "no_assistant_turn", "no assistant turn"),
    (  # JSON's \u escapes can spell half of a UTF-16 pair, which no tokenizer takes
        {"conversations": [{"role": "user", "content": "a\ud800b"}, REPLY]},
        "invalid_utf8",
        "turn 1 (user) content holds an unpaired surrogate \\ud800 at character 1",
    ),
    ({"id": "x\udc00", "conversations": [USER, REPLY]}, "invalid_utf8", "'id' holds an unpaired surrogate"),
    ({"id": "ok", "conversations": [USER, REPLY]}, "duplicate_id", "duplicate id 'ok' (first on line 1)"),
]


@pytest.mark.parametrize("line,code,reason", MALFORMED, ids=[case[1] for case in MALFORMED])
def test_malformed_line_fails_with_line_number_and_reason(tiny_tokenizer, tmp_path, line, code, reason):
    path = _write_jsonl(tmp_path / "bad.jsonl", [VALID, line])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{re.escape(reason)}"):
        prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="fail")


def test_skip_reports_every_malformed_line_and_keeps_all_valid(tiny_tokenizer, tmp_path):
    lines, expected_errors = [], {}
    for i, (line, code, reason) in enumerate(MALFORMED):
        lines.append({"id": f"valid-{i}", "messages": [USER, REPLY]})  # the `messages` key is accepted
        lines.append(line)
        expected_errors[len(lines)] = (code, reason)
    lines[0]["id"] = "ok"  # so that the duplicate-id case has an earlier line to clash with
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="skip")

    assert dataset["id"] == ["ok"] + [f"valid-{i}" for i in range(1, len(MALFORMED))]
    assert summary["num_lines"] == len(lines) and summary["num_kept"] == len(MALFORMED)
    assert summary["num_dropped"] == len(MALFORMED)
    assert summary["dropped_by_reason"] == dict(Counter(code for _, code, _ in MALFORMED))
    reported = {error["line"]: (error["code"], error["reason"]) for error in summary["errors"]}
    assert reported.keys() == expected_errors.keys()
    for line_number, (code, reason) in expected_errors.items():
        assert reported[line_number][0] == code and reason in reported[line_number][1]


def test_worker_processes_prepare_what_one_process_does(tiny_tokenizer, tmp_path, monkeypatch):
    """Lines rendered by worker processes, a few lines a task: the same rows in the same order, the
    same summary, the same first error with on_error=fail as one process, across the tasks' edges."""
    from dflash2.data import prepare

    monkeypatch.setattr(prepare, "LINES_PER_TASK", 3)
    spelled = _spelled_out(tiny_tokenizer, REPLY["content"])
    lines = [line for line, _, _ in MALFORMED]
    lines += [VALID, {"id": "ids", "conversations": [USER, {**REPLY, "token_ids": spelled}]}]
    lines += [
        {"id": "again", "conversations": [USER, REPLY]},
        {"id": "long", "conversations": [USER] * 9 + [REPLY]},
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    with path.open("ab") as f:
        f.write(b'{"id": "latin", "conversations": [{"role": "user", "content": "caf\xe9"}]}\n')
    one, one_summary = prepare_dataset(path, tiny_tokenizer, max_length=64, duplicates="drop")
    two, two_summary = prepare_dataset(path, tiny_tokenizer, max_length=64, duplicates="drop", num_proc=2)
    assert one_summary["num_lines"] == len(lines) + 1 and one_summary["num_kept"] == 2  # the premise
    assert {"duplicate", "duplicate_id", "invalid_utf8", "prompt_too_long"} <= set(
        one_summary["dropped_by_reason"]
    )
    assert two.to_dict() == one.to_dict() and two_summary == one_summary
    with pytest.raises(ValueError) as first:
        prepare_dataset(path, tiny_tokenizer, max_length=64, on_error="fail")
    with pytest.raises(ValueError, match=re.escape(str(first.value))):
        prepare_dataset(path, tiny_tokenizer, max_length=64, on_error="fail", num_proc=2)
    for bad in (0, 1.5, True, np.bool_(True)):
        with pytest.raises(ValueError, match="num_proc must be a whole number of processes, at least 1"):
            prepare_dataset(path, tiny_tokenizer, max_length=64, num_proc=bad)
    numpy_one = prepare_dataset(path, tiny_tokenizer, max_length=64, duplicates="drop", num_proc=np.int64(1))
    assert numpy_one[0].to_dict() == one.to_dict() and numpy_one[1] == one_summary


def test_an_error_of_a_line_in_a_worker_comes_after_the_lines_before_it(
    tiny_tokenizer, tmp_path, monkeypatch
):
    """A line that raises something other than a malformed sample's error, in a task of several lines:
    with on_error=fail, an earlier malformed line of the same task is still the error reported."""
    from dflash2.data import prepare

    monkeypatch.setattr(prepare, "LINES_PER_TASK", 4)
    unknown = {"id": "x", "conversations": [USER, {**REPLY, "content": "RAISE"}]}
    path = _write_jsonl(tmp_path / "raise.jsonl", [VALID, "{oops", unknown, VALID])
    tokenizer = copy.deepcopy(tiny_tokenizer)  # a template that fails on one reply, not as a refusal
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{%- for", "{{ 1 / 0 if 'RAISE' in messages|string else '' }}{%- for", 1
    )
    for num_proc in (1, 2):
        with pytest.raises(ValueError, match="raise.jsonl:2: invalid JSON"):
            prepare_dataset(path, tokenizer, 256, on_error="fail", num_proc=num_proc)
        with pytest.raises(ZeroDivisionError):
            prepare_dataset(path, tokenizer, 256, on_error="skip", num_proc=num_proc)


class _EndsTheProcess:
    """A tokenizer stand-in whose unpickling ends the process: a worker that dies as it starts."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_worker_that_dies_is_reported_with_the_fix(tmp_path):
    path = _write_jsonl(tmp_path / "one.jsonl", [VALID])
    with pytest.raises(
        RuntimeError, match=r"num_proc=2\) ended before it rendered its lines .*lower num_proc"
    ):
        prepare_dataset(path, _EndsTheProcess(), max_length=64, num_proc=2)


def test_a_script_without_the_main_guard_or_from_stdin_is_told_the_fix(tiny_default, tmp_path):
    """Without the guard, each `spawn` worker runs the script again and, before this, the pool hung;
    a script read from stdin cannot be run again by a worker (it hung too)."""
    path = _write_jsonl(tmp_path / "one.jsonl", [VALID])
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from transformers import AutoTokenizer\n"
        "from dflash2.data.prepare import prepare_dataset\n"
        f"tokenizer = AutoTokenizer.from_pretrained({str(tiny_default.target_dir)!r})\n"
        f"prepare_dataset({str(path)!r}, tokenizer, 64, num_proc=2)\n"
    )
    unguarded = subprocess.run(
        [sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert unguarded.returncode == 1
    assert (
        'ran while a worker process started: put the script\'s call under `if __name__ == "__main__":`'
        in (unguarded.stderr)
    )
    assert "num_proc=2) ended before it rendered its lines (BrokenProcessPool" in unguarded.stderr
    from_stdin = subprocess.run(
        [sys.executable, "-"], input=script.read_text(), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert from_stdin.returncode == 1
    assert (
        "and '<stdin>' is not a file it can run (a script read from stdin, a zip archive?): save the script"
        in from_stdin.stderr
    )


def test_truncation_and_untrainable_samples_are_counted(tiny_tokenizer, tmp_path):
    full_mask = expected_loss_mask(tiny_tokenizer, [USER, REPLY])
    first_reply_token = full_mask.index(1)
    path = _write_jsonl(tmp_path / "short.jsonl", [VALID])

    # One supervised token left after truncation: no anchor with a label after it, and so no sample
    # to train on at all (an empty dataset that training then failed on with an IndexError)
    with pytest.raises(ValueError, match=r"can be trained on \(no_trainable_block x1; each line's reason"):
        prepare_dataset(path, tiny_tokenizer, max_length=first_reply_token + 1)

    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=first_reply_token + 2)
    assert summary["num_kept"] == 1 and dataset[0]["loss_mask"] == full_mask[: first_reply_token + 2]
    assert summary["num_truncated"] == 1

    # beside it, a longer prompt whose cut leaves one reply token: dropped, and its cut not counted
    # (the summary counts the truncation of the samples it keeps)
    longer = {"id": "long", "conversations": [{**USER, "content": USER["content"] + " now"}, REPLY]}
    longer_first_reply = expected_loss_mask(tiny_tokenizer, longer["conversations"]).index(1)
    assert longer_first_reply == first_reply_token + 1  # one token more: one reply token within the cut
    both = _write_jsonl(tmp_path / "both.jsonl", [VALID, longer])
    dataset, summary = prepare_dataset(both, tiny_tokenizer, max_length=first_reply_token + 2)
    assert dataset["id"] == ["ok"] and summary["dropped_by_reason"] == {"no_trainable_block": 1}
    assert summary["num_truncated"] == 1  # "ok" alone


def test_a_byte_order_mark_costs_no_line(tiny_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "bom.jsonl", [VALID, {**VALID, "id": "second"}])
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())  # as editors that save 'UTF-8 with BOM' write
    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=128, on_error="fail")
    assert dataset["id"] == ["ok", "second"] and summary["num_kept"] == 2  # line 1 failed before


def test_prepare_cli_writes_loadable_dataset_and_summary(tiny_default, tmp_path, monkeypatch):
    path = _write_jsonl(tmp_path / "in.jsonl", [VALID, "{oops"])
    out = tmp_path / "prepared"
    arguments = ["--input", str(path), "--tokenizer", str(tiny_default.target_dir), "--out", str(out)]
    arguments += ["--max-length", "128", "--chat-template-kwargs", '{"enable_thinking": false}']
    run_script_main(monkeypatch, "data_prep/prepare.py", arguments)
    dataset = load_prepared(out)
    assert dataset["id"] == ["ok"] and sum(dataset[0]["loss_mask"]) > 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_kept"] == 1 and summary["dropped_by_reason"] == {"invalid_json": 1}
    assert summary["chat_template_kwargs"] == {"enable_thinking": False}

    with pytest.raises(ValueError, match="in.jsonl:2: invalid JSON"):
        run_script_main(
            monkeypatch,
            "data_prep/prepare.py",
            arguments + ["--out", str(tmp_path / "again"), "--on-error", "fail", "--num-proc", "2"],
        )


def test_a_run_refuses_a_prepared_directory_rendered_with_other_chat_template_kwargs(
    tiny_default, tiny_tokenizer, tmp_path
):
    # the export records the run's data.chat_template_kwargs, which evaluation and serving render with
    from dflash2.config import DataConfig
    from dflash2.data.prepare import build_dataset, save_prepared

    kwargs = {"enable_thinking": False}
    dataset, summary = prepare_dataset(
        _write_jsonl(tmp_path / "in.jsonl", [VALID]), tiny_tokenizer, 128, chat_template_kwargs=kwargs
    )
    out = save_prepared(dataset, summary, tmp_path / "prepared")
    with pytest.raises(
        ValueError,
        match=r"prepared with chat_template_kwargs \{'enable_thinking': False\}, but this run's "
        r"data.chat_template_kwargs is \{\}.*set data.chat_template_kwargs to",
    ):
        build_dataset(DataConfig(train=str(out)), tiny_tokenizer, is_main=True)
    loaded = build_dataset(
        DataConfig(train=str(out), chat_template_kwargs=kwargs), tiny_tokenizer, is_main=True
    )
    assert loaded["input_ids"] == dataset["input_ids"]


def test_a_run_refuses_a_prepared_directory_cut_longer_than_its_max_length(tiny_tokenizer, tmp_path):
    # the run is sized by data.max_length (batches, memory plan, capture); a prepared directory is
    # loaded as it is, so samples cut at a longer length trained past it before
    from dflash2.config import DataConfig
    from dflash2.data.prepare import build_dataset, save_prepared

    dataset, summary = prepare_dataset(_write_jsonl(tmp_path / "in.jsonl", [VALID]), tiny_tokenizer, 4096)
    out = save_prepared(dataset, summary, tmp_path / "prepared")
    length = len(dataset[0]["input_ids"])
    with pytest.raises(
        ValueError, match=r"prepared with max_length 4096, longer than this run's data.max_length 64"
    ):
        build_dataset(DataConfig(train=str(out), max_length=64), tiny_tokenizer, is_main=True)
    assert (
        len(build_dataset(DataConfig(train=str(out), max_length=4096), tiny_tokenizer, True)[0]["input_ids"])
        == length
    )


def test_load_prepared_rejects_other_directories(tmp_path):
    with pytest.raises(ValueError, match="not a prepared dataset"):
        load_prepared(tmp_path)


# ---- bad data loses no good data ----------------------------------------------------------------------


def test_a_line_that_is_not_utf8_is_reported_with_its_byte_offset_and_the_rest_is_prepared(
    tiny_tokenizer, tmp_path, caplog
):
    good = json.dumps(VALID).encode() + b"\n"
    bad = (
        json.dumps({"id": "latin-1", "conversations": [USER, REPLY]}).encode().replace(b"Count", b"Co\xfcnt")
    )
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(good + bad + b"\n" + json.dumps({**VALID, "id": "after"}).encode() + b"\n")
    offset = len(good) + bad.index(b"\xfc")  # of the bad byte in the file, counted independently
    with caplog.at_level("WARNING"):
        dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="skip")
    assert dataset["id"] == ["ok", "after"] and summary["dropped_by_reason"] == {"invalid_utf8": 1}
    assert summary["errors"][0]["line"] == 2 and f"byte offset {offset}" in summary["errors"][0]["reason"]
    assert f"mixed.jsonl:2: not valid UTF-8 at byte offset {offset}" in caplog.text
    with pytest.raises(ValueError, match=f"mixed.jsonl:2: not valid UTF-8 at byte offset {offset}"):
        prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="fail")


def test_an_empty_input_is_an_error(tiny_tokenizer, tmp_path):
    for name, content in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=f"{name} holds no conversation"):
            prepare_dataset(tmp_path / name, tiny_tokenizer, max_length=256)


def test_a_cut_line_reports_the_column_where_it_ends(tiny_tokenizer, tmp_path):
    cut = json.dumps(VALID)[:40]
    path = _write_jsonl(tmp_path / "cut.jsonl", [{**VALID, "id": "first"}, cut])
    _, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="skip")
    assert summary["errors"] == [
        {
            "line": 2,
            "code": "invalid_json",
            "reason": f"invalid JSON ({json_error(cut)} at column {len(cut) + 1})",
        }
    ]


def json_error(text: str) -> str:
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        return error.msg
    raise AssertionError(f"{text!r} is valid JSON")


def test_every_dropped_conversation_is_reported_with_its_line_and_reason(tiny_tokenizer, tmp_path, caplog):
    prompt_length = expected_loss_mask(tiny_tokenizer, [USER, REPLY]).index(1)  # tokens before the reply
    long_user = {"role": "user", "content": " ".join(["word"] * 200)}
    lines = [VALID, {"id": "long", "conversations": [long_user, REPLY]}, "{oops", {**VALID, "id": "fine"}]
    path = _write_jsonl(tmp_path / "data.jsonl", lines)
    with caplog.at_level("WARNING"):
        dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=prompt_length + 40)
    assert dataset["id"] == ["ok", "fine"]
    assert summary["dropped_by_reason"] == {"invalid_json": 1, "prompt_too_long": 1}
    reasons = {error["line"]: error["reason"] for error in summary["errors"]}
    assert reasons.keys() == {2, 3} and "prompt longer than max_length" in reasons[2]
    assert (
        "data.jsonl:2: prompt longer than max_length" in caplog.text
        and "data.jsonl:3: invalid JSON" in caplog.text
    )


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_duplicates_are_reported_and_kept_or_dropped(tiny_tokenizer, tmp_path, caplog, policy):
    other = {"id": "other", "conversations": [{"role": "user", "content": "Count from 1 to 3."}, REPLY]}
    lines = [VALID, other, {**VALID, "id": "copy"}, {"conversations": VALID["conversations"]}]
    path = _write_jsonl(tmp_path / "dups.jsonl", lines)
    with caplog.at_level("WARNING"):
        dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, duplicates=policy)
    assert summary["num_duplicates"] == 2 and summary["duplicates_policy"] == policy
    assert summary["duplicates"] == [{"line": 3, "first_line": 1}, {"line": 4, "first_line": 1}]
    assert f"dups.jsonl:3: duplicate of line 1 ({'kept' if policy == 'keep' else 'dropped'})" in caplog.text
    if policy == "keep":
        assert dataset["id"] == ["ok", "other", "copy", "line-4"] and summary["num_dropped"] == 0
    else:
        assert dataset["id"] == ["ok", "other"] and summary["dropped_by_reason"] == {"duplicate": 2}


def test_the_trainer_reports_what_it_kept_and_dropped_on_rank_0_only(
    tiny_tokenizer, tmp_path, capsys, caplog
):
    from dflash2.config import DataConfig
    from dflash2.data.prepare import build_dataset

    path = tmp_path / "train.jsonl"
    path.write_bytes(json.dumps(VALID).encode() + b"\n\xff\xfe\n" + json.dumps({**VALID, "id": "b"}).encode())
    data = DataConfig(train=str(path), max_length=256, on_error="skip")
    with caplog.at_level("WARNING"):
        assert build_dataset(data, tiny_tokenizer, is_main=False)["id"] == ["ok", "b"]
    assert capsys.readouterr().out == "" and caplog.text == ""
    with caplog.at_level("WARNING"):
        build_dataset(data, tiny_tokenizer, is_main=True)
    assert "train.jsonl:2: not valid UTF-8 at byte offset" in caplog.text
    out = capsys.readouterr().out
    assert "kept 2 of 3 conversations, dropped 1 (invalid_utf8: 1), duplicates 1 (kept)" in out
    assert "prepare it once" not in out


def test_a_run_whose_data_tokenises_slowly_is_told_to_prepare_it_once(
    tiny_default, tiny_tokenizer, tmp_path, capsys, monkeypatch
):
    from dflash2.config import DataConfig
    from dflash2.data import prepare

    monkeypatch.setattr(prepare, "SLOW_PREPARE_S", 0.0)
    data = DataConfig(train=str(_write_jsonl(tmp_path / "train.jsonl", [VALID])), max_length=256)
    prepare.build_dataset(data, tiny_tokenizer, is_main=False)
    assert capsys.readouterr().out == ""
    prepare.build_dataset(data, tiny_tokenizer, is_main=True)
    said = capsys.readouterr().out
    command = re.search(
        r"tokenising .*train.jsonl took \d+ s, .*in parallel \((.*)\), and set data.train", said
    )
    assert command, said
    # the command it names prepares the data as the run does: the run accepts what it writes
    arguments = command.group(1).split()[2:]  # after "python data_prep/prepare.py"
    assert arguments[arguments.index("--max-length") + 1] == "256" and "--duplicates" in arguments
    out = tmp_path / "prepared"
    values = {"<the": str(tiny_default.target_dir), "<cores>": "1", "<dir>": str(out)}
    arguments = [values.get(a, a) for a in arguments if a not in ("target's", "directory>")]
    run_script_main(monkeypatch, "data_prep/prepare.py", arguments)
    assert prepare.build_dataset(data.model_copy(update={"train": str(out)}), tiny_tokenizer, True)["id"] == [
        "ok"
    ]


# ---- exact labels: replies that carry the target's token ids -------------------------------------


def _spelled_out(tokenizer, text: str) -> list[int]:
    """Ids of `text` one character at a time: they decode to `text` but are not its tokenisation."""
    return [tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in text]


def test_a_reply_with_token_ids_trains_on_them_and_the_mismatch_is_counted(tiny_tokenizer, tmp_path):
    text = REPLY["content"]
    spelled = _spelled_out(tiny_tokenizer, text)
    assert tiny_tokenizer.decode(spelled) == text
    canonical = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert spelled != canonical  # the premise: ids that do not re-tokenise from the text
    rows = [
        {"id": "spelled", "conversations": [USER, {**REPLY, "token_ids": spelled}]},
        {"id": "canonical", "conversations": [USER, {**REPLY, "token_ids": canonical}]},
        {"id": "text-only", "conversations": [USER, REPLY]},
    ]
    dataset, summary = prepare_dataset(_write_jsonl(tmp_path / "ids.jsonl", rows), tiny_tokenizer, 256)

    # Reference: what a server feeds the target, what the target generated, its end-of-turn token.
    prompt = _ids(tiny_tokenizer, [USER], add_generation_prompt=True)
    newline = tiny_tokenizer("\n", add_special_tokens=False)["input_ids"]
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, reply_ids in zip(dataset, (spelled, canonical)):
        assert row["input_ids"] == prompt + reply_ids + [im_end] + newline
        assert row["loss_mask"] == [0] * len(prompt) + [1] * (len(reply_ids) + 1) + [0] * len(newline)
    assert dataset[2]["input_ids"] == _ids(tiny_tokenizer, [USER, REPLY])
    assert (
        dataset[2]["loss_mask"]
        == dataset[1]["loss_mask"]
        == expected_loss_mask(tiny_tokenizer, [USER, REPLY])
    )
    assert summary["num_with_token_ids"] == 2
    assert summary["num_token_ids_mismatch"] == 1 and summary["token_ids_mismatch_lines"] == [1]


def test_mismatched_token_ids_are_logged_a_few_lines_then_counted(tiny_tokenizer, tmp_path, caplog):
    """Expected of real targets and trained on their ids: the first MAX_LOGGED_MISMATCHES lines one
    by one, the rest in one line; the summary still has every count and line."""
    from dflash2.data.prepare import MAX_LOGGED_MISMATCHES

    spelled = _spelled_out(tiny_tokenizer, REPLY["content"])
    rows = [
        {"id": str(i), "conversations": [{**USER, "content": f"{i}"}, {**REPLY, "token_ids": spelled}]}
        for i in range(MAX_LOGGED_MISMATCHES + 3)
    ]
    with caplog.at_level("WARNING"):
        _, summary = prepare_dataset(_write_jsonl(tmp_path / "ids.jsonl", rows), tiny_tokenizer, 256)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:-1] == [
        f"{tmp_path / 'ids.jsonl'}:{n}: the reply text does not re-tokenise to its token_ids (trained on the ids)"
        for n in range(1, MAX_LOGGED_MISMATCHES + 1)
    ]
    assert lines[-1].startswith(
        f"{tmp_path / 'ids.jsonl'}: 3 more samples do not re-tokenise to their token_ids"
    )
    assert summary["num_token_ids_mismatch"] == MAX_LOGGED_MISMATCHES + 3
    assert summary["token_ids_mismatch_lines"] == list(range(1, MAX_LOGGED_MISMATCHES + 4))


def test_token_ids_of_every_reply_of_a_multi_turn_conversation_are_used(tiny_tokenizer, tmp_path):
    second_user = {"role": "user", "content": "And back?"}
    second = {"role": "assistant", "content": "9, 8, 7, 6, 5, 4, 3."}
    messages = [USER, {**REPLY, "token_ids": _spelled_out(tiny_tokenizer, REPLY["content"])}, second_user]
    messages.append({**second, "token_ids": _spelled_out(tiny_tokenizer, second["content"])})
    dataset, _ = prepare_dataset(
        _write_jsonl(tmp_path / "two.jsonl", [{"conversations": messages}]), tiny_tokenizer, 512
    )

    # Reference: the canonical tokenisation with each reply's tokens (its loss-mask run, less the
    # end-of-turn token) replaced by the reply's own ids.
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    canonical, mask = _ids(tiny_tokenizer, plain), expected_loss_mask(tiny_tokenizer, plain)
    expected, expected_mask, position = [], [], 0
    for reply in (messages[1], messages[3]):
        start = mask.index(1, position)
        end = mask.index(0, start) - 1  # the end-of-turn token
        expected += canonical[position:start] + reply["token_ids"] + [canonical[end]]
        expected_mask += [0] * (start - position) + [1] * (len(reply["token_ids"]) + 1)
        position = end + 1
    expected += canonical[position:]
    expected_mask += [0] * (len(canonical) - position)
    assert dataset[0]["input_ids"] == expected and dataset[0]["loss_mask"] == expected_mask


BAD_TOKEN_IDS = [
    ({**REPLY, "token_ids": "1 2 3"}, "'token_ids' must be a list of integer token ids in [0, 2^31)"),
    ({**REPLY, "token_ids": [5, -1]}, "'token_ids' must be a list of integer token ids in [0, 2^31)"),
    ({**REPLY, "token_ids": [5, 1.5]}, "'token_ids' must be a list of integer token ids in [0, 2^31)"),
    ({**REPLY, "token_ids": [True]}, "'token_ids' must be a list of integer token ids in [0, 2^31)"),
    ({**REPLY, "token_ids": [5, 2**31]}, "'token_ids' must be a list of integer token ids in [0, 2^31)"),
    ({**REPLY, "token_ids": []}, "'token_ids' is empty"),
]


@pytest.mark.parametrize("reply,reason", BAD_TOKEN_IDS)
def test_malformed_token_ids_are_a_clear_per_line_error(tiny_tokenizer, tmp_path, reply, reason):
    path = _write_jsonl(tmp_path / "bad.jsonl", [VALID, {"id": "bad", "conversations": [USER, reply]}])
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{re.escape(reason)}"):
        prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="fail")
    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="skip", quiet=True)
    assert dataset["id"] == ["ok"] and summary["dropped_by_reason"] == {"bad_token_ids": 1}


def test_a_dropped_line_is_no_first_occurrence_and_its_token_ids_are_not_counted(tiny_tokenizer, tmp_path):
    """What the summary counts of duplicates and of token ids is of the samples kept."""
    too_long = {"conversations": [{"role": "user", "content": "word " * 300}, REPLY]}
    ids = tiny_tokenizer(REPLY["content"], add_special_tokens=False)["input_ids"]
    with_ids = {"conversations": [{"role": "user", "content": "word " * 300}, {**REPLY, "token_ids": ids}]}
    path = _write_jsonl(tmp_path / "data.jsonl", [VALID, too_long, too_long, with_ids])
    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=64, quiet=True)
    assert dataset["id"] == ["ok"]
    assert summary["dropped_by_reason"] == {"prompt_too_long": 3}
    assert summary["num_duplicates"] == 0  # before: line 3 a duplicate (kept) of line 2, then dropped
    assert summary["num_with_token_ids"] == 0  # before: 1, of a dropped line


def test_token_ids_on_a_user_turn_are_an_error(tiny_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"conversations": [{**USER, "token_ids": [5]}, REPLY]}])
    with pytest.raises(
        ValueError, match="bad.jsonl:1: turn 1 \\(user\\) has 'token_ids'; only replies carry them"
    ):
        prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="fail")


def test_token_ids_that_do_not_decode_to_their_reply_are_a_per_line_error(tiny_tokenizer, tmp_path):
    # a reply edited after its ids were generated would train on the old ids
    other = tiny_tokenizer("Something else entirely.", add_special_tokens=False)["input_ids"]
    stale = {"id": "stale", "conversations": [USER, {**REPLY, "token_ids": other}]}
    path = _write_jsonl(tmp_path / "stale.jsonl", [VALID, stale])
    message = r"stale.jsonl:2: reply 1: its 'token_ids' do not decode to its content"
    assert_second_line_dropped(path, tiny_tokenizer, message, "token_ids_stale")


def assert_second_line_dropped(path: Path, tokenizer, message: str, reason: str) -> None:
    """The file's second line stops the run with `message` (on_error=fail), or is dropped for `reason`
    while the first (VALID) is kept (on_error=skip)."""
    with pytest.raises(ValueError, match=message):
        prepare_dataset(path, tokenizer, max_length=256, on_error="fail")
    dataset, summary = prepare_dataset(path, tokenizer, max_length=256, on_error="skip", quiet=True)
    assert dataset["id"] == ["ok"] and summary["dropped_by_reason"] == {reason: 1}


def test_a_conversation_the_chat_template_refuses_is_a_per_line_error(tiny_tokenizer, tmp_path):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)  # a template that raises, like those refusing a system turn
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    system = {"id": "system", "conversations": [{"role": "system", "content": "Be brief."}, USER, REPLY]}
    path = _write_jsonl(tmp_path / "system.jsonl", [VALID, system])
    message = r"system.jsonl:2: the chat template refuses this conversation: System role"
    assert_second_line_dropped(path, tokenizer, message, "template_error")


def test_a_token_id_outside_the_targets_vocabulary_is_refused_naming_the_sample():
    from datasets import Dataset

    from dflash2.data.prepare import check_token_ids_in_vocab

    dataset = Dataset.from_dict({"id": ["a", "b", "c"], "input_ids": [[1, 2, 3], [4, 999, 5], [998]]})
    check_token_ids_in_vocab(dataset, 1000)  # every id inside: accepted
    with pytest.raises(
        ValueError, match=r"sample 'b' holds token id 999, outside the target's vocabulary of 999"
    ):
        check_token_ids_in_vocab(dataset, 999)
    with pytest.raises(
        ValueError, match=r"sample 'b' holds token id 999, outside the target's vocabulary of 998"
    ):
        check_token_ids_in_vocab(dataset, 998)  # the first sample past it is named


def test_a_reply_cut_at_the_length_limit_supervises_no_end_of_turn_token(tiny_tokenizer, tmp_path):
    # the target did not end the reply there: the template's end-of-turn token is not its label
    ids = _spelled_out(tiny_tokenizer, REPLY["content"])
    rows = [
        {"id": "cut", "conversations": [USER, {**REPLY, "finish_reason": "length"}]},
        {"id": "cut-ids", "conversations": [USER, {**REPLY, "token_ids": ids, "finish_reason": "length"}]},
        {"id": "ended", "conversations": [USER, {**REPLY, "token_ids": ids, "finish_reason": "stop"}]},
    ]
    dataset, _ = prepare_dataset(_write_jsonl(tmp_path / "cut.jsonl", rows), tiny_tokenizer, 256)
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    whole = expected_loss_mask(tiny_tokenizer, [USER, REPLY])
    eot = dataset[0]["input_ids"].index(im_end, whole.index(1))
    assert whole[eot] == 1 and dataset[0]["loss_mask"] == whole[:eot] + [0] + whole[eot + 1 :]
    assert dataset[0]["input_ids"] == _ids(tiny_tokenizer, [USER, REPLY])  # the same tokens
    for cut, row in ((True, dataset[1]), (False, dataset[2])):
        eot = row["input_ids"].index(im_end, row["loss_mask"].index(1))
        assert row["loss_mask"][eot] == int(not cut) and sum(row["loss_mask"]) == len(ids) + int(not cut)


def test_a_finish_reason_on_a_user_turn_or_not_a_string_is_a_per_line_error(tiny_tokenizer, tmp_path):
    rows = [
        VALID,
        {"id": "user", "conversations": [{**USER, "finish_reason": "length"}, REPLY]},
        {"id": "number", "conversations": [USER, {**REPLY, "finish_reason": 1}]},
    ]
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"bad.jsonl:2: turn 1 \(user\): 'finish_reason' is why a reply ended"
    ):
        prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="fail")
    dataset, summary = prepare_dataset(path, tiny_tokenizer, max_length=256, on_error="skip", quiet=True)
    assert dataset["id"] == ["ok"] and summary["dropped_by_reason"] == {"bad_finish_reason": 2}
