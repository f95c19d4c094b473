"""The paged KV pool's memory: reserved, not touched, at start; resident where written; given back
after a burst, oldest unheld pages first."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from llama_chat.inference.page_table import PageTable
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedKVCache

linux = pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc/self/statm")


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


class FakePool:
    """Gives back every page asked for but those in ``stuck``; records what it was asked."""

    def __init__(self, keep: int, stuck: frozenset[int] = frozenset()) -> None:
        self.keep_pages = keep
        self.stuck = stuck
        self.asked: list[list[int]] = []

    def return_pages(self, pages: list[int]) -> list[int]:
        self.asked.append(pages)
        return [p for p in pages if p not in self.stuck]


def test_written_pages_are_reused_first_and_the_oldest_unheld_go_back_once_none_is_held():
    pool = FakePool(keep=3)
    table = PageTable(12, pool)
    a, b, c = table.allocate(3), table.allocate(2), table.allocate(2)
    assert table.resident == 1 + 7
    table.release(a)
    assert pool.asked == [] and table.unheld_resident == 3
    again = table.allocate(3)
    assert sorted(again) == sorted(a)  # written pages first, not fresh ones
    table.release(again)
    table.release(b)
    assert pool.asked == []  # 5 unheld while a job runs: not past twice the keep
    table.release(c)  # nothing held: 7 unheld down to the keep, the oldest released first
    # A block table is released last page first; pages never written go along (runs' fillers).
    assert pool.asked == [sorted(again + [b[1]] + [8, 9, 10, 11])]
    assert table.unheld_resident == 3 and table.resident == 4 and table.returned == 4
    assert sorted(p for p in range(12) if table.written[p]) == sorted([SCRATCH_PAGE, b[0], *c])
    # Given-back pages are taken after every written one.
    assert sorted(table.allocate(3)) == sorted([b[0], *c])


def test_cached_pages_go_back_after_free_ones_and_lose_their_prefix():
    pool = FakePool(keep=1)
    table = PageTable(8, pool)
    kept, spare = table.allocate(2), table.allocate(1)
    for page, key in zip(kept, (b"k1", b"k2")):
        table.register(page, key)
    table.release(kept)  # 2 unheld: the prefix of the sequence released last stays whole
    assert pool.asked == []
    table.release(spare)  # 3 unheld, keep 1: the free page, then the oldest cached (the prefix's tail)
    assert pool.asked == [sorted([spare[0], kept[1], 4, 5, 6, 7])]
    assert table.lookup([b"k1", b"k2"]) == [kept[0]] and list(table.cached) == [kept[0]]


def test_a_page_the_pool_could_not_give_back_stays_resident_and_free():
    pool = FakePool(keep=0, stuck=frozenset({2}))
    table = PageTable(6, pool)
    pages = table.allocate(3)
    table.release(pages)
    assert table.written[2] and not table.written[1] and table.resident == 2
    assert table.free[-1] == 2 and table.available == 5


@linux
def test_a_large_pool_takes_memory_only_where_written_and_gives_it_back():
    before = rss()
    # 2 layers x keys and values x 2 heads x 4096 pages x 16 slots x 64 floats: 128 MiB reserved.
    cache = PagedKVCache(2, 4096, 16, 2, 64)
    assert rss() - before < 8 * 2**20
    pages = list(range(1, 1025))
    for store in (*cache.keys, *cache.values):
        store[:, 1:1025] = 1.0
    written = rss() - before
    assert written > 28 * 2**20  # a quarter of the pool
    returned = cache.return_pages(pages)
    assert returned == pages  # a run of whole 4 KiB pages (each is 4 KiB a head here)
    assert rss() - before < written - 24 * 2**20
    assert all(float(store[:, 1:1025].abs().sum()) == 0.0 for store in cache.keys)


@linux
def test_a_lone_page_smaller_than_the_systems_stays_but_its_run_goes_back():
    # 16 slots x 16 floats: 1 KiB a head and page; a run of four aligned pages is one system page.
    cache = PagedKVCache(1, 64, 16, 2, 16)
    for store in (*cache.keys, *cache.values):
        store.fill_(2.0)
    assert cache.return_pages([5]) == []
    assert cache.return_pages([4, 5, 6, 7, 9]) == [4, 5, 6, 7]
    assert float(cache.keys[0][:, 4:8].abs().sum()) == 0.0
    assert float(cache.keys[0][:, 9].abs().sum()) > 0 and float(cache.keys[0][:, 3].abs().sum()) > 0


def test_a_cache_on_another_device_gives_nothing_back():
    cache = PagedKVCache(1, 8, 4, 1, 8, device="meta")
    assert cache.return_pages([1, 2, 3]) == []


def test_the_serve_pool_fills_the_batch_within_half_the_free_memory_but_holds_a_context():
    from llama_chat.cmd.generation_source import POOL_BYTES_UNKNOWN, pool_tokens

    assert pool_tokens(1000, 2048, 16, 10**12) == 16 * 2048  # room for every slot
    assert pool_tokens(1000, 2048, 16, 20 * 10**6) == 10**4  # half of 20 MB, at 1 KB a token
    assert pool_tokens(1000, 2048, 16, 10**5) == 2048  # never less than one context
    assert pool_tokens(1000, 2048, 16, None) == min(16 * 2048, POOL_BYTES_UNKNOWN // 1000)


def test_a_cuda_pool_is_sized_from_the_devices_free_memory(monkeypatch):
    """The device's own free memory, read after the weights are on it (a stand-in for the CUDA
    call here: no GPU in the tests), and the host's for anything else."""
    import torch

    from llama_chat.model import memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 10**9, 80 * 10**9))
    monkeypatch.setattr(memory_budget, "available_bytes", lambda: 5 * 10**9)
    assert memory_budget.available_on(torch.device("cuda", 0)) == 3 * 10**9
    assert memory_budget.available_on(torch.device("cpu")) == 5 * 10**9


def scheduler_jobs(model, tokenizer, prompts, **options):
    """Each prompt a greedy job, all at once: their tokens, and the stats before and after."""
    import anyio

    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(**options)) as scheduler:
            streams = [scheduler.submit(Request(p, sampling=SamplingParams(temperature=0.0), max_tokens=6))
                       for p in prompts]
            out = {}
            async with anyio.create_task_group() as tg:
                async def consume(i, stream):
                    async for _ in stream:
                        pass
                    out[i] = stream.completion().token_ids
                for i, stream in enumerate(streams):
                    tg.start_soon(consume, i, stream)
            for stream in streams:
                await scheduler.wait_released(stream)
            return [out[i] for i in range(len(streams))], scheduler.stats

    return anyio.run(main)


def test_a_scheduler_of_q8_0_pages_gives_each_job_its_tokens_alone_and_gives_pages_back(sp_model_path, monkeypatch):
    import torch

    from builders import random_model, tiny_args
    from llama_chat.model import paged_kv_cache
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size, dim=128, n_heads=4, n_kv_heads=2, max_seq_len=512), seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, tokenizer.vocab_size, (200 + 90 * i,), generator=g).tolist() for i in range(3)]
    monkeypatch.setattr(paged_kv_cache, "KEEP_UNHELD_BYTES", 0)  # give every page back at the end
    together, stats = scheduler_jobs(model, tokenizer, prompts, cache_type="q8_0", page_size=64)
    alone = [scheduler_jobs(model, tokenizer, [p], cache_type="q8_0", page_size=64)[0][0] for p in prompts]
    assert together == alone
    page_bytes = stats.kv_reserved_bytes // (stats.pages_total + 1)
    # Some 16 pages were written; a page of a head is 2,176 bytes here, so the system's pages
    # cover runs of them: all went back but the scratch page, the last job's full pages (its
    # prefix, for the next request: its prompt's run and its reply's) and those at the two ends
    # of each run.
    assert stats.pages_peak >= 14
    last_prefix = max((len(p) + 6) // 64 for p in prompts)
    assert page_bytes <= stats.kv_resident_bytes <= (1 + last_prefix + 2 * 2) * page_bytes


def test_a_scheduler_of_q4_0_pages_keeps_keys_by_the_models_measure_and_each_job_its_tokens_alone(sp_model_path):
    """The measure is made as the scheduler is, before a key is written; the prompts' pages are
    written by the model's forward and the replies' by the operator, each by the same measure."""
    import torch

    from builders import random_model, tiny_args
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size, dim=128, n_heads=4, n_kv_heads=2, max_seq_len=512), seed=2)
    g = torch.Generator().manual_seed(4)
    prompts = [[1] + torch.randint(3, tokenizer.vocab_size, (40 + 30 * i,), generator=g).tolist() for i in range(3)]
    together, _ = scheduler_jobs(model, tokenizer, prompts, cache_type="q4_0", page_size=16)
    alone = [scheduler_jobs(model, tokenizer, [p], cache_type="q4_0", page_size=16)[0][0] for p in prompts]
    assert together == alone
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions

    pages = Scheduler(model, tokenizer, SchedulerOptions(cache_type="q4_0", max_batch=2)).core.cache
    assert pages.key_centers is not None and len(pages.key_centers.shift) == model.args.n_layers
    assert Scheduler(model, tokenizer, SchedulerOptions(cache_type="q8_0", max_batch=2)).core.cache.key_centers is None


def test_a_cache_type_the_models_heads_cannot_take_is_one_line(sp_model_path):
    from builders import random_model, tiny_args
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size), seed=2)  # heads of 16
    with pytest.raises(ValueError, match=r"^--cache-type q4_0 needs a head size that is a multiple of 32, "
                                         r"and this model's is 16$"):
        Scheduler(model, tokenizer, SchedulerOptions(cache_type="q4_0"))


def test_every_command_gets_its_cache_type_and_pool_from_the_one_composition_root(sp_model_path):
    """A prompt's, --batch's and serve's sources are made by ``generation_source.make_source``: a
    type the model's heads cannot keep is the same one line (``ModelLoadError``: exit status 2,
    a server's load error) for each, and each command's pool is sized there."""
    import torch

    from builders import random_model, tiny_args
    from llama_chat.cmd.generation_source import cache_type, make_source, pool_size, pool_tokens
    from llama_chat.cmd.source_settings import BATCH_JOBS, ONE_STREAM, SERVER_JOBS, LoadSettings, SourceSettings
    from llama_chat.model.errors import ModelLoadError
    from llama_chat.model.loader import LoadedModel
    from llama_chat.model.memory_budget import available_on
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size), seed=2)  # heads of 16
    loaded = LoadedModel(model, model.args, tokenizer, None, Path(sp_model_path), "tiny", torch.device("cpu"),
                         torch.float32, "meta")
    for jobs in (ONE_STREAM, BATCH_JOBS, SERVER_JOBS):
        with pytest.raises(ModelLoadError, match=r"^--cache-type q4_0 needs a head size that is a multiple of 32"):
            make_source(loaded, SourceSettings(LoadSettings(), jobs=jobs, cache_type="q4_0"))
    assert cache_type(SourceSettings(LoadSettings()), loaded).name == "f16"  # auto on the CPU
    assert cache_type(SourceSettings(LoadSettings(), compile=True), loaded).name == "f32"  # read as it is
    kind = cache_type(SourceSettings(LoadSettings(), cache_type="bf16"), loaded)
    a = model.args
    sizes = {jobs: pool_size(SourceSettings(LoadSettings(), jobs=jobs, max_batch=4), loaded, kind)
             for jobs in (ONE_STREAM, BATCH_JOBS, SERVER_JOBS)}
    served = pool_tokens(2 * a.n_layers * a.n_kv_heads * kind.token_bytes(a.head_dim), a.max_seq_len, 4,
                         available_on(loaded.device))
    assert sizes == {ONE_STREAM: a.max_seq_len, BATCH_JOBS: None, SERVER_JOBS: served}
    given = SourceSettings(LoadSettings(), jobs=SERVER_JOBS, cache_tokens=100)
    assert pool_size(given, loaded, kind) == 100


def test_once_no_job_is_left_the_core_frees_its_buffers_and_trims_the_heap(sp_model_path, monkeypatch):
    import anyio
    import torch

    from builders import random_model, tiny_args
    from llama_chat.inference import batch_core
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.paged_kv_cache import PagedKVCache
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    trims, drops = [], []
    monkeypatch.setattr(batch_core, "release_heap", lambda: trims.append(1))
    real_drop = PagedKVCache.drop_buffers
    monkeypatch.setattr(PagedKVCache, "drop_buffers", lambda self: (drops.append(1), real_drop(self)))
    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size, dim=64, n_heads=2, n_kv_heads=1, max_seq_len=128), seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, tokenizer.vocab_size, (20,), generator=g).tolist() for _ in range(2)]

    async def main():
        async with Scheduler(model, tokenizer, SchedulerOptions(cache_type="f16")) as scheduler:
            for round_ in (1, 2):
                streams = [scheduler.submit(Request(p, sampling=SamplingParams(temperature=0.0), max_tokens=4))
                           for p in prompts]
                for stream in streams:
                    async for _ in stream:
                        pass
                    await scheduler.wait_released(stream)
                with anyio.fail_after(10):
                    while len(trims) < round_:
                        await anyio.sleep(0.01)
                await anyio.sleep(0.05)
                assert len(trims) == len(drops) == round_  # once a burst, not at every idle step

    anyio.run(main)


def test_a_files_key_measure_is_kept_and_read_back_until_the_file_changes(sp_model_path, tmp_path, monkeypatch):
    import torch

    from builders import random_model, tiny_args
    from llama_chat.model import key_centers
    from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tokenizer = SentencePieceTokenizer(sp_model_path)
    model = random_model(tiny_args(tokenizer.vocab_size, dim=128, n_heads=4, n_kv_heads=2), seed=2)
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    first = key_centers.of_model(model, tokenizer, source=source)
    kept = list((tmp_path / "cache" / "llama-chat" / "key-centers").glob("*.pt"))
    assert len(kept) == 1

    def measured_again(*args):
        raise AssertionError("a kept measure was measured again")

    with monkeypatch.context() as m:
        m.setattr(key_centers, "measure", measured_again)
        again = key_centers.of_model(model, tokenizer, source=source)
    assert all(torch.equal(a, b) for a, b in zip(first.shift + first.scale, again.shift + again.scale))
    # A kept file that is not a measure of this model is measured anew (and kept over).
    kept[0].write_bytes(b"not a measure")
    assert key_centers.of_model(model, tokenizer, source=source) is not None
    assert key_centers.read_kept(kept[0], model) is not None
    # Another file under the same name is another model.
    source.write_bytes(b"other weights")
    assert key_centers.kept_path(model, [1, 2, 3], source) != key_centers.kept_path(model, [1, 2, 3], tmp_path / "x")
    with monkeypatch.context() as m:
        m.setattr(key_centers, "measure", measured_again)
        with pytest.raises(AssertionError, match="measured again"):
            key_centers.of_model(model, tokenizer, source=source)


def test_the_last_sequence_keeps_its_whole_prefix_past_the_keep_and_an_older_one_goes_back():
    pool = FakePool(keep=2)
    table = PageTable(16, pool)
    long, short = table.allocate(6), table.allocate(3)
    for i, page in enumerate(long):
        table.register(page, f"long{i}".encode())
    for i, page in enumerate(short[:2]):  # the last page is not full: no key
        table.register(page, f"short{i}".encode())
    table.release(short)
    table.release(long)  # nothing held: the long prompt's 6 pages stay, not the keep's 2
    assert table.lookup([f"long{i}".encode() for i in range(6)]) == long
    assert table.lookup([b"short0", b"short1"]) == []  # older, and past the keep: given back
    assert table.unheld_resident == 6
    again = table.allocate(1)
    table.register(again[0], b"next0")
    table.release(again)  # a short sequence next: the keep is the pool's again, the oldest go
    assert table.unheld_resident == 2 and table.lookup([b"next0"]) == again
