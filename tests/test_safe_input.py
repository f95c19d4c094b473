"""The one rule for files and lines from outside (``ml/safe_files.py``, ``model/safe_input.py``) and
the two readers most exposed to it: a ``--batch`` line and a ``/load`` file. Whatever bytes or JSON
they are given, the line is a job or one error record and the file a conversation or one error,
never an exception (property tests)."""

from __future__ import annotations

import io
import json
import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_chat.cmd import batch_input
from llama_chat.cmd.batch_input import BadLine, BatchReader, JobLine, parse_line
from llama_chat.cmd.conversation_file import (ConversationError, Turn, load_conversation, parse_conversation,
                                              save_conversation)
from llama_chat.ml.safe_files import UnsafeFile, inside, read_regular, write_atomic
from llama_chat.model.safe_input import BadInput, NotText, check_text, loads

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
# Objects with the keys a batch line or a saved conversation has, holding anything.
batch_objects = st.fixed_dictionaries({}, optional={
    key: json_values for key in ("prompt", "id", "system", "max_tokens", "temperature", "seed", "stop",
                                 "logit_bias", "top_k", "max_time", "json_schema", "regex")})
conversation_objects = st.fixed_dictionaries({}, optional={
    "format": json_values, "system": json_values,
    "messages": st.lists(st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", 3]),
                                                             "content": json_values,
                                                             "interrupted": json_values}), max_size=6)})


def _job_or_record(item) -> None:
    assert isinstance(item, (JobLine, BadLine))
    if isinstance(item, BadLine):
        assert item.message and "\n" not in item.message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_any_bytes_are_a_job_or_one_error_record(data):
    _job_or_record(parse_line(1, data))
    _job_or_record(parse_line(1, b"{" + data))


# 100 objects, Hypothesis's own default, for the two JSON properties: drawing nested values costs
# far more than parsing them (the 300 raw byte strings above and below cost little), and each key's
# checks have tests by name (test_cli_batch.py, test_hostile_inputs*.py, /load in the second).
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_objects)
def test_any_json_object_is_a_job_or_one_error_record(obj):
    _job_or_record(parse_line(1, json.dumps(obj)))
    _job_or_record(parse_line(1, json.dumps(obj).encode()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_are_a_conversation_or_one_error(data):
    for raw in (data, b'{"messages": ' + data + b"}"):
        try:
            system, turns = parse_conversation(raw)
        except ConversationError as e:
            assert "\n" not in str(e)
        else:
            assert system is None or isinstance(system, str)
            assert all(isinstance(t, Turn) for t in turns)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # as above
@given(conversation_objects)
def test_any_json_is_a_conversation_or_one_error(obj):
    try:
        system, turns = parse_conversation(json.dumps(obj).encode())
    except ConversationError as e:
        assert str(e).startswith("not a saved conversation (") and "\n" not in str(e)
    else:
        assert [t.role for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert all(isinstance(t.content, str) for t in turns)


@pytest.mark.parametrize("text, problem", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ' + "[" * 65 + "]" * 65 + "}", "nested more than 64 deep"),
    ("[" + "9" * 41 + "]", "an integer of 41 digits"),
    ("[-1e400]", "the number -1e400 is too large"),
    ("[NaN]", "NaN is not a valid JSON value"),
    ('["\\udc80"]', "lone surrogate (U+DC80)"),
    ('{"\\ud800": 1}', "lone surrogate (U+D800)"),
])
def test_json_past_its_bounds_is_one_problem(text, problem):
    with pytest.raises(BadInput, match=problem.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        loads(text)


def test_bounded_json_that_is_fine_passes():
    assert loads('{"a": ["\\ud83d\\ude00", 12345678901234567890, 1.5e300, "[{\\"not nesting"]}') == {
        "a": ["\U0001F600", 12345678901234567890, 1.5e300, '[{"not nesting']}
    assert loads(b"\xef\xbb\xbf[1]") == [1]
    assert loads("[" * 64 + "]" * 64) is not None


def test_command_line_bytes_are_named_as_bytes():
    with pytest.raises(NotText, match=r"--prompt is not valid UTF-8 \(byte 0xff at character 4\)"):
        check_text("hi \udcff", "--prompt")
    assert check_text("fine ✓", "--prompt") == "fine ✓"


def test_files_that_are_not_regular_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a directory")):
        with pytest.raises(UnsafeFile, match=f"not a regular file \\({kind}\\)"):
            read_regular(path, 100)
    assert time.monotonic() - started < 60  # a FIFO opened without O_NONBLOCK would block for ever
    big = tmp_path / "big"
    big.write_bytes(b"x" * 101)
    with pytest.raises(UnsafeFile, match="larger than 100 bytes"):
        read_regular(big, 100)
    assert read_regular(big, 101) == b"x" * 101


def test_symlinks_must_stay_inside_their_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "file").write_text("x")
    (root / "in").symlink_to("sub/file")
    (root / "out").symlink_to("/etc/hostname")
    (root / "up").symlink_to("../..")
    assert inside(root / "in", root) == (root / "sub" / "file").resolve()
    for name in ("out", "up"):
        with pytest.raises(UnsafeFile, match="leads outside"):
            inside(root / name, root)


def test_an_atomic_write_replaces_a_fifo_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "note"
    os.mkfifo(target)
    write_atomic(target, b"done\n")
    assert target.read_bytes() == b"done\n" and sorted(p.name for p in tmp_path.iterdir()) == ["note"]


def test_a_batch_line_past_the_bound_is_one_record_and_the_next_line_is_read(monkeypatch):
    monkeypatch.setattr(batch_input, "MAX_LINE_BYTES", 100)
    monkeypatch.setattr(batch_input, "_SKIP_CHUNK", 7)
    reader = BatchReader(io.BufferedReader(io.BytesIO(b"first\n" + b"y" * 1000 + b"\n\nlast")), "test")
    items = reader.take(10)
    assert [type(i).__name__ for i in items] == ["JobLine", "BadLine", "JobLine"]
    assert items[1] == BadLine(2, 2, "longer than 100 bytes")
    assert items[2].line == 4 and items[2].prompt == "last"
    assert reader.take(10) == [] and reader.eof


def test_save_and_load_round_trip_and_refuse_what_is_not_a_file(tmp_path):
    path = tmp_path / "chat.json"
    save_conversation(str(path), {"system": "be brief", "messages": [
        {"role": "user", "content": "hi ✓"}, {"role": "assistant", "content": "hello", "interrupted": True}]})
    system, turns = load_conversation(str(path))
    assert system == "be brief" and turns == [Turn("user", "hi ✓"), Turn("assistant", "hello", True)]
    with pytest.raises(ConversationError, match="no user 'nosuchuser-here'"):
        load_conversation("~nosuchuser-here/chat.json")
    with pytest.raises(ConversationError, match="not a regular file \\(a directory\\)"):
        save_conversation(str(tmp_path), {})
