"""The generation controls through the installed command: beam search under --json, --max-time,
the penalties changing the answer, bad values as one-line usage errors, --help's sections, and
the chat's /set for every control."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from cli_support import build_tiny_model, cli_env, command_request, json_result, run_cli, spawn_cli
from llama_chat.inference.beam import BeamLimits, BeamSearch
from llama_chat.inference.scheduler import Scheduler
from llama_chat.inference.types import GenerationState
from llama_chat.ml.controls import BeamParams, SamplingParams
from llama_chat.model.loader import load_model
from terminal_support import save_and_leave

WAIT_S = 120  # generous: a busy 2-core machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("controls"))


def test_num_beams_4_json_gives_every_returned_beam_with_its_score(tiny):
    args = ("-m", str(tiny.path), "-p", "Once upon a time", "--num-beams", "4", "--num-return", "3", "-n", "10",
            "--length-penalty", "0.5", "--early-stopping", "true", "--json")
    out = json_result(run_cli(*args, "--seed", "3"))
    beams = out["beams"]
    assert len(beams) == 3
    scores = [b["score"] for b in beams]
    assert scores == sorted(scores, reverse=True)
    assert out["text"] == beams[0]["text"] and out["token_ids"] == beams[0]["token_ids"]
    assert out["score"] == scores[0] and out["finish_reason"] == beams[0]["finish_reason"] == "max_tokens"
    assert all(len(b["token_ids"]) == 10 for b in beams) and len({tuple(b["token_ids"]) for b in beams}) == 3

    # Without -t the search is deterministic, as transformers' without do_sample: another seed
    # gives the same beams, and so does the greedy search in the library, on the same weights.
    again = json_result(run_cli(*args, "--seed", "4"))["beams"]
    assert [b["token_ids"] for b in again] == [b["token_ids"] for b in beams]
    loaded = load_model(tiny.path, device="cpu", dtype="float32")
    prompt = loaded.tokenizer.encode("Once upon a time", bos=True)
    assert out["prompt_tokens"] == len(prompt)
    search = BeamSearch(loaded.model, prompt, SamplingParams(temperature=0.0), BeamParams(4, 0.5, True, 3),
                        limits=BeamLimits(10, GenerationState.MAX_TOKENS, time.perf_counter()),
                        stop_ids={loaded.tokenizer.eos_id}, seed=3, vocab=loaded.tokenizer.vocab_size,
                        device=torch.device("cpu"), dtype=torch.float32)
    while search.prefill(64):
        pass
    while search.step():
        pass
    assert [list(b.token_ids) for b in search.result()] == [b["token_ids"] for b in beams]
    for ours, theirs in zip(search.result(), beams):
        assert ours.score == pytest.approx(theirs["score"], abs=1e-5)


def test_beam_search_prints_the_best_beam_to_a_pipe(tiny):
    proc = run_cli("-m", str(tiny.path), "-p", "Once upon a time", "--num-beams", "3", "-n", "6", "--seed", "1")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.strip()
    assert b"finish: max_tokens" in proc.stderr and b"score: " in proc.stderr


def test_max_time_is_its_own_finish_reason(tiny):
    out = json_result(run_cli("-m", str(tiny.path), "-p", "Once", "--max-time", "0.000001", "--json", "-t", "0"))
    assert out["finish_reason"] == "max_time" and out["completion_tokens"] == 1


def test_penalties_change_a_greedy_answer_and_the_same_seed_repeats_a_sampled_one(tiny):
    # The option sets parsed and run in this process as the command does; the sampled one also
    # through the command, which must repeat it.
    base = ("-m", str(tiny.path), "-p", "Once upon a time", "-n", "24", "--json")
    scheduler = Scheduler.from_loaded(loaded := load_model(tiny.path, device="cpu"))
    plain = scheduler.generate(command_request(loaded, *base, "-t", "0")).token_ids
    ids = scheduler.generate(command_request(
        loaded, *base, "-t", "0", "--repetition-penalty", "1.5", "--no-repeat-ngram-size", "2",
        "--frequency-penalty", "0.5", "--logit-bias", f"{plain[0]}=-inf")).token_ids
    assert ids[0] != plain[0]  # the ban holds
    pairs = [tuple(ids[i:i + 2]) for i in range(len(ids) - 1)]
    assert len(pairs) == len(set(pairs))  # no bigram twice in the reply
    sampled = (*base, "-t", "0.9", "--top-k", "20", "--min-p", "0.01", "--typical-p", "0.95",
               "--presence-penalty", "0.3", "--seed", "7")
    here = scheduler.generate(command_request(loaded, *sampled)).token_ids
    assert scheduler.generate(command_request(loaded, *sampled)).token_ids == here != plain
    assert json_result(run_cli(*sampled))["token_ids"] == list(here)


@pytest.mark.parametrize(("args", "message"), [
    (("--top-k", "-1"), "'--top-k': must be an integer >= 0 (0: off), got -1"),
    (("--min-p", "1.5"), "'--min-p': must be in 0 <= p <= 1 (0: off), got 1.5"),
    (("--typical-p", "0"), "'--typical-p': must be in 0 < p <= 1 (1: off), got 0.0"),
    (("--repetition-penalty", "0"), "'--repetition-penalty' / '--repeat-penalty': must be a finite number > 0"),
    (("--repeat-last-n", "-2"), "must be an integer >= 0 (0: every token so far), got -2"),
    (("--presence-penalty", "5"), "'--presence-penalty': must be in -2 <= x <= 2 (0: off), got 5.0"),
    (("--frequency-penalty", "nan"), "'--frequency-penalty': must be in -2 <= x <= 2"),
    (("--no-repeat-ngram-size", "-1"), "'--no-repeat-ngram-size': must be an integer >= 0"),
    (("--logit-bias", "hello"), "'--logit-bias': must be ID=BIAS (for example 15043=-inf), got 'hello'"),
    (("--logit-bias", "99999=1"), "--logit-bias: token id 99999 is outside the vocabulary (0 to 511)"),
    (("--min-new-tokens", "-3"), "'--min-new-tokens': must be an integer >= 0, got -3"),
    (("--max-time", "0"), "'--max-time': must be a number of seconds > 0, got 0.0"),
    (("--num-beams", "0"), "'--num-beams': must be an integer in 1 <= n <= 64 (1: no beam search), got 0"),
    (("--length-penalty", "inf"), "'--length-penalty': must be in -10 <= x <= 10"),
    (("--early-stopping", "soon"), "'--early-stopping': must be true, false or never, got 'soon'"),
    (("--num-beams", "2", "--num-return", "3"), "--num-return must be at most --num-beams (2), got 3"),
])
def test_bad_values_are_one_line_usage_errors(tiny, args, message):
    proc = run_cli("-m", str(tiny.path), "-p", "hi", *args)
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("llama-chat: error: ") and message in lines[0], lines[0]
    assert b"Traceback" not in proc.stderr


def test_help_groups_the_controls():
    helped = run_cli("--help", COLUMNS="200").stdout.decode()
    sections = {}
    current = None
    for line in helped.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = ""
        elif current:
            sections[current] += line + "\n"
    assert "--top-k" in sections["Sampling (Hugging Face generate's names)"]
    for option in ("--repetition-penalty", "--repeat-penalty", "--no-repeat-ngram-size", "--logit-bias",
                   "--presence-penalty", "--frequency-penalty", "--min-new-tokens", "--repeat-last-n"):
        assert option in sections["Penalties and token rules"], option
    for option in ("--max-time", "--max-tokens", "--stop"):
        assert option in sections["Stopping"], option
    for option in ("--num-beams", "--length-penalty", "--early-stopping", "--num-return"):
        assert option in sections["Beam search"], option
    assert "--model" in sections["Options"]


# -- the chat's /set --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, sp_model_path, sp_vocab_size) -> Path:
    """A random model whose end token (2, the SentencePiece builder's) never wins, so replies run to -n."""
    model = random_model(tiny_args(sp_vocab_size, max_seq_len=512), seed=4)
    with torch.no_grad():
        model.output.weight[[2]] = 0.0
    out = write_meta_checkpoint(model, tmp_path_factory.mktemp("chat_controls") / "m", sp_model_path)
    return out


def test_chat_set_changes_every_control_and_beam_replies(chat_model, tmp_path):
    child = spawn_cli(["-m", str(chat_model), "--template", "llama2", "-n", "6", "-t", "0",
                       "--no-history"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, encoding="utf-8",
                      dimensions=(40, 200))
    child.expect_exact(">>> ")
    for setting, shown in [("top-k=5", "top_k = 5"), ("min_p=0.1", "min_p = 0.1"), ("typical_p=0.9", "typical_p = 0.9"),
                           ("repeat_penalty=1.3", "repetition_penalty = 1.3"), ("repeat_last_n=32", "repeat_last_n = 32"),
                           ("presence_penalty=0.5", "presence_penalty = 0.5"),
                           ("frequency_penalty=0.25", "frequency_penalty = 0.25"),
                           ("no_repeat_ngram_size=2", "no_repeat_ngram_size = 2"),
                           ("logit_bias=7=-inf", "logit_bias = ['7=-inf']"), ("min_new_tokens=3", "min_new_tokens = 3"),
                           ("max_time=30", "max_time = 30.0"), ("length_penalty=0.5", "length_penalty = 0.5"),
                           ("early_stopping=never", "early_stopping = never"), ("num_beams=3", "num_beams = 3"),
                           ("num_return_sequences=2", "num_return = 2")]:
        child.sendline(f"/set {setting}")
        child.expect_exact(shown)
        child.expect_exact(">>> ")
    child.sendline("/set top_k=-4")
    child.expect_exact("top_k must be an integer >= 0 (0: off), got -4")
    child.expect_exact(">>> ")
    child.sendline("/set num_return=5")
    child.expect_exact("num_return must be at most num_beams (3), got 5")
    child.expect_exact(">>> ")
    child.sendline("Tell me a story")
    child.expect_exact(">>> ")  # a beam reply: not streamed, then the prompt again
    child.sendline("/set num_beams=1")
    child.expect_exact(">>> ")
    child.sendline("And another")
    child.expect_exact(">>> ")
    saved = save_and_leave(child, tmp_path / "talk.json")
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2
    assert all(m["content"] for m in saved["messages"])
    settings = saved["settings"]
    assert settings["top_k"] == 5 and settings["logit_bias"] == ["7=-inf"] and settings["early_stopping"] == "never"
    assert settings["num_beams"] == 1 and settings["num_return"] == 1  # lowered with num_beams


def test_chat_set_takes_name_value_or_name_equals_value_and_suggests_a_name(chat_model, tmp_path):
    child = spawn_cli(["-m", str(chat_model), "--template", "llama2", "-n", "4", "--no-history"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=WAIT_S, encoding="utf-8",
                      dimensions=(40, 200))
    child.expect_exact(">>> ")
    for typed, shown in [("/set temperature 0.5", "temperature = 0.5"), ("/set temperature=0", "temperature = 0.0"),
                         ("/set top-k 7", "top_k = 7"), ("/set stop </s>", "stop = ['</s>']"),
                         ("/set temprature=0", "unknown setting 'temprature'; did you mean temperature?"),
                         ("/set top_p 1.01", "top_p must be in 0 < p <= 1, got 1.01"),
                         ("/set seed", "seed = None")]:
        child.sendline(typed)
        child.expect_exact(shown)
        child.expect_exact(">>> ")
    child.sendline("Hello")
    child.expect_exact(">>> ")
    settings = save_and_leave(child, tmp_path / "talk.json")["settings"]
    assert (settings["temperature"], settings["top_k"], settings["stop"], settings["top_p"]) == (0.0, 7, ["</s>"], 0.95)
