"""The prompt cache on disk (``model/prompt_cache.py``): a prompt's full pages written by one
process are read by another, which answers with the same logits; a block that is damaged,
truncated, or made for another model or cache type is never used; readers sharing the folder with
a writer never see half a block; a full disk is said once and generation goes on."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import anyio
import pytest
import torch

from builders import random_model, tiny_args
from cli_support import run_python
from llama_chat.inference.page_table import page_keys
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model import prompt_cache as prompt_cache_mod
from llama_chat.model.prompt_cache import HEADER, PromptCache, PromptCacheSettings

VOCAB = 96
EOS = 2
TESTS = Path(__file__).resolve().parent
PROMPT = tuple([1] + [(7 * i) % 90 + 3 for i in range(44)])  # five full pages of 8 before its last token
ONE_GIB = 1 << 30


class Bytes:
    """Just enough of a tokenizer for the scheduler: ids as letters."""

    vocab_size = VOCAB
    eos_id = EOS
    stop_ids = frozenset({EOS})
    special_tokens: dict[str, int] = {}
    strips_leading_space = False

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id % 26])


def scheduler_of(directory: Path | None, cache_type: str = "f32", lines: list[str] | None = None,
                 max_bytes: int = ONE_GIB, seed: int = 11) -> Scheduler:
    settings = None if directory is None else PromptCacheSettings(
        directory, max_bytes, say=(lines.append if lines is not None else lambda line: None))
    # Heads of 32 values (q8_0 pages keep blocks of 32), two of queries to one of keys.
    model = random_model(tiny_args(VOCAB, n_heads=2, n_kv_heads=1, max_seq_len=256), seed=seed)
    with torch.no_grad():
        model.output.weight[EOS] = 0.0  # never ends before its budget
    return Scheduler(model, Bytes(), SchedulerOptions(max_batch=1, page_size=8, cache_tokens=512,
                                                      cache_type=cache_type, prompt_cache=settings))


def answer(scheduler: Scheduler, prompt=PROMPT, tokens: int = 6) -> tuple[list[int], list[list[float]]]:
    """The greedy reply's ids and each token's top-3 log-probabilities."""
    request = Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=tokens, logprobs=3)

    async def main():
        async with scheduler:
            async with scheduler.submit(request) as stream:
                async for _ in stream:
                    pass
        return ([token for token, _ in stream.logprobs],
                [[drawn.logprob] + [value for _, value in drawn.top] for _, drawn in stream.logprobs])

    return anyio.run(main)


WRITER = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from pathlib import Path
from test_prompt_cache import answer, scheduler_of
scheduler = scheduler_of(Path(sys.argv[1]), sys.argv[2])
cold = answer(scheduler)
warm = answer(scheduler)  # the same prompt again: its pages from memory
scheduler.core.prompt_cache.flush(60)
print(json.dumps({{"cold": cold, "warm": warm, "written": scheduler.core.prompt_cache.counts.written_blocks,
                  "cached": scheduler.stats.cached_tokens}}))
"""


def write_in_another_process(directory: Path, cache_type: str) -> dict:
    done = run_python(WRITER, str(directory), cache_type, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_here(directory: Path) -> None:
    scheduler = scheduler_of(directory)
    answer(scheduler)
    assert scheduler.core.prompt_cache.flush(60)


def test_pages_written_by_one_process_give_another_the_same_logits(tmp_path):
    """q8_0 pages: blocks of 8-bit values and their scales, as the pool keeps them."""
    cache_type = "q8_0"
    written = write_in_another_process(tmp_path, cache_type)
    assert written["written"] >= 5 and written["cached"] >= 40
    lines: list[str] = []
    scheduler = scheduler_of(tmp_path, cache_type, lines)
    ids, logprobs = answer(scheduler)
    assert scheduler.core.counters.disk_tokens == 40  # five pages of eight: only the last token computed
    assert scheduler.core.prompt_cache.counts.read_blocks == 5 and not lines
    # The pages hold what the writer's held, byte for byte.
    core = scheduler.core
    for key in page_keys(PROMPT[:-1], 8):
        block = (core.prompt_cache.folder / f"{key.hex()}.kv").read_bytes()
        assert core.cache.page_payload(core.pages.by_key[key]).numpy().tobytes() == block[HEADER.size:]
    # So the answer is the writer's, cold and with its pages from memory; the logits only as close
    # as a step over pages laid out elsewhere in the pool computes them.
    for run in ("cold", "warm"):
        assert ids == written[run][0]
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(written[run][1]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("other", [{"cache_type": "bf16"}, {"seed": 12}], ids=["cache type", "model"])
def test_a_block_of_another_cache_type_or_model_is_never_used(tmp_path, other):
    write_here(tmp_path)
    lines: list[str] = []
    scheduler = scheduler_of(tmp_path, lines=lines, **other)
    answer(scheduler)
    # Another fingerprint: another folder, nothing read, nothing skipped.
    assert scheduler.core.counters.disk_tokens == 0 and not lines
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_foreign_damaged_and_truncated_blocks_are_skipped_with_one_line_each(tmp_path):
    write_here(tmp_path)
    cold = answer(scheduler_of(None))
    lines: list[str] = []
    scheduler = scheduler_of(tmp_path, "f32", lines)
    folder = scheduler.core.prompt_cache.folder
    blocks = sorted(folder.glob("*.kv"), key=lambda p: p.stat().st_mtime)
    assert len(blocks) >= 5
    first, second = blocks[0], blocks[1]
    # The first page's block damaged: one byte of its keys changed.
    data = bytearray(first.read_bytes())
    data[HEADER.size + 100] ^= 0x40
    first.write_bytes(bytes(data))
    assert answer(scheduler) == cold
    assert scheduler.core.counters.disk_tokens == 0
    assert len(lines) == 1 and "damaged" in lines[0] and first.name in lines[0], lines
    # Written again once computed: the next process reads it.
    scheduler.core.prompt_cache.flush(60)
    again = scheduler_of(tmp_path, "f32")
    assert answer(again) == answer(scheduler) and again.core.counters.disk_tokens == 40
    # Truncated, and another model's block under this one's name: skipped.
    lines.clear()
    first.write_bytes(first.read_bytes()[:HEADER.size + 10])
    fresh = scheduler_of(tmp_path, "f32", lines)
    answer(fresh)
    assert len(lines) == 1 and "truncated" in lines[0], lines
    fresh.core.prompt_cache.flush(60)
    foreign = bytearray(second.read_bytes())
    foreign[8:24] = bytes(16)  # the fingerprint its header names
    lines.clear()
    for block in blocks:
        block.write_bytes(bytes(foreign))
    fresh = scheduler_of(tmp_path, "f32", lines)
    assert answer(fresh)[0] == cold[0] and fresh.core.counters.disk_tokens == 0
    assert len(lines) == 1 and "another model" in lines[0], lines


def test_a_full_disk_is_said_once_and_generation_goes_on(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prompt_cache_mod.os, "replace", full)
    cold = answer(scheduler_of(None))
    lines: list[str] = []
    scheduler = scheduler_of(tmp_path, "f32", lines)
    longer = PROMPT + tuple(range(3, 40))
    assert answer(scheduler) == cold
    answer(scheduler, longer)
    assert scheduler.core.prompt_cache.flush(60)
    assert len(lines) == 1 and "disk is full" in lines[0], lines
    assert scheduler.core.prompt_cache.counts.written_blocks == 0
    assert not list(scheduler.core.prompt_cache.folder.iterdir())  # no temporary file left


def test_the_least_recently_used_blocks_go_past_the_size(tmp_path):
    block = 8 + 4 * 64  # a small page's bytes
    cache = PromptCache(PromptCacheSettings(tmp_path, 3 * (HEADER.size + block)), bytes(16), block)
    keys = [bytes([i]) * 16 for i in range(5)]
    for key in keys[:3]:
        cache.write(key, torch.full((block,), key[0], dtype=torch.uint8))
    assert cache.flush(60)
    assert cache.read(keys[0]) is not None  # used: kept past a newer one
    for key in keys[3:]:
        cache.write(key, torch.full((block,), key[0], dtype=torch.uint8))
    assert cache.flush(60)
    present = {bytes.fromhex(p.stem) for p in cache.folder.glob("*.kv")}
    assert present == {keys[0], keys[3], keys[4]} and cache.counts.evicted_blocks == 2
    assert cache.read(keys[4]) == bytes([4]) * block and cache.read(keys[1]) is None


def test_readers_beside_a_writer_never_see_half_a_block(tmp_path):
    """Another process writing blocks of a megabyte into the folder: a reader finds each one
    whole or not yet there, never one it must skip."""
    block = 1 << 20
    writer = PromptCache(PromptCacheSettings(tmp_path, ONE_GIB), bytes(16), block)
    lines: list[str] = []
    reader = PromptCache(PromptCacheSettings(tmp_path, ONE_GIB, say=lines.append), bytes(16), block)
    keys = [i.to_bytes(16, "little") for i in range(40)]

    def write_all() -> None:
        for key in keys:
            writer.write(key, torch.full((block,), key[0], dtype=torch.uint8))
            writer.flush(60)

    thread = threading.Thread(target=write_all)
    thread.start()
    whole = set()
    while thread.is_alive() or len(whole) < len(keys):
        for key in keys:
            payload = reader.read(key)
            if payload is not None:
                assert payload == bytes([key[0]]) * block
                whole.add(key)
        assert len(whole) == len(keys) or thread.is_alive(), "a block written is missing"
    thread.join(60)
    assert writer.counts.written_blocks == len(keys) and not lines, lines


def test_the_command_reads_what_an_earlier_run_wrote(tmp_path):
    """Through the installed command, twice: the second run's prompt pages come from the first
    run's blocks, and its reply is the same; a folder it cannot use is one line, status 2."""
    from cli_support import build_tiny_model, run_cli

    tiny = build_tiny_model(tmp_path)
    folder = tmp_path / "prompt cache"
    common = ("-m", str(tiny.path), "-t", "0", "-n", "12", "--template", "none", "--prompt-cache", str(folder),
              "-p", " ".join(["one two three four five six seven eight nine ten"] * 8))
    first = run_cli(*common, "--json")
    second = run_cli(*common, "--json", "--stats")
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]
    assert "tokens from disk" not in first.stderr.decode()
    assert "tokens from disk" in second.stderr.decode(), second.stderr
    bad = run_cli(*common[:-2], "--prompt-cache", str(tmp_path / "tiny" / "params.json"), "-p", "hi")
    assert bad.returncode == 2
    lines = bad.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--prompt-cache" in lines[0] and "Traceback" not in lines[0], lines


def test_two_servers_share_one_folder(tmp_path):
    """One server writes a long prompt's pages; another, started beside it on the same folder,
    reads them for the same prompt (its /metrics count them) and answers the same."""
    from cli_support import build_tiny_model
    from serve_support import start_server, stop_server, wait_for

    tiny = build_tiny_model(tmp_path)
    folder = tmp_path / "blocks"
    prompt = " ".join(["one two three four five six seven eight nine ten"] * 8)
    servers = [None, None]

    def start(i: int) -> None:
        servers[i] = start_server(tiny.path, "--prompt-cache", str(folder), "--max-batch", "2")

    starting = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for thread in starting:
        thread.start()
    for thread in starting:
        thread.join(300)
    first, second = servers
    assert first is not None and second is not None
    try:
        def ask(server) -> str:
            return server.client().completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                                      temperature=0).choices[0].text

        said = ask(first)
        wait_for(lambda: first.metrics()["llama_chat_prompt_cache_blocks_written_total"] >= 4, "the blocks written")
        assert ask(second) == said
        assert second.metrics()["llama_chat_prompt_cache_disk_tokens_total"] >= 64
        assert second.metrics()["llama_chat_prompt_cache_blocks_skipped_total"] == 0
    finally:
        for server in servers:
            stop_server(server)
