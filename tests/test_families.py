"""The model families against ``transformers``: Qwen2, Qwen3, Mistral with a sliding window shorter
than the prompt, Gemma 2 (soft caps, a query scale, windowed layers), Gemma 3 (q/k norms, local and
global rotary bases, linear scaling) and Phi-3 (fused tensors, LongRoPE), each a tiny random model.

Each is loaded from its ``save_pretrained`` folder and from a GGUF file written as llama.cpp's
converter writes its family (``builders_families``), and run through the layers' cache, the
scheduler with eight jobs at once, and packed Q8_0 blocks.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import sentencepiece as spm
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from builders import cached_greedy, decode_one  # noqa: E402
from builders_families import FAMILY_NAMES, WINDOW, hf_family_model, round_trip, write_family_gguf  # noqa: E402
from builders_gguf import T  # noqa: E402
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions  # noqa: E402
from llama_chat.inference.types import Request  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402
from llama_chat.ml.sampling import SamplingParams  # noqa: E402
from llama_chat.model import cpu_decode  # noqa: E402
from llama_chat.model.errors import ModelLoadError  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.paged_kv_cache import PagedKVCache  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer  # noqa: E402

PROMPT_LEN = 40  # past every window (WINDOW)
NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0)
NEAR_TIE = 0.2  # logits closer than this may swap under packed products' 8-bit input rows
assert PROMPT_LEN > WINDOW


@pytest.fixture(scope="module")
def vocab(sp_model_path) -> int:
    return spm.SentencePieceProcessor(model_file=str(sp_model_path)).vocab_size()


@pytest.fixture(scope="module")
def references(vocab):
    """Each family's reference model (built once: transformers' construction is the slow part), its
    vocabulary the tokenizer's: the command samples only the tokenizer's ids."""
    return {family: hf_family_model(family, vocab, seed=len(family)) for family in FAMILY_NAMES}


def _prompt(vocab: int, seed: int = 1, n: int = PROMPT_LEN) -> torch.Tensor:
    return torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(hf, prompt: torch.Tensor, n: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n)
    return out[0, prompt.shape[1]:].tolist()


def _saved(hf, out: Path, sp_model_path: Path) -> Path:
    if not out.exists():
        hf.save_pretrained(out)
        (out / "tokenizer.model").write_bytes(sp_model_path.read_bytes())
    return out


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hugging_face_checkpoint_gives_transformers_logits_and_greedy_tokens(
        tmp_path_factory, sp_model_path, references, vocab, family):
    hf = references[family]
    loaded = load_model(_saved(hf, tmp_path_factory.mktemp(family) / "hf", sp_model_path), device="cpu",
                        dtype="float32")
    assert loaded.args.family == family
    prompt = _prompt(vocab)
    with torch.inference_mode():
        want = hf(prompt).logits.float()
        got = loaded.model(prompt)
    assert (got - want).abs().max().item() <= 1e-4
    assert cached_greedy(loaded.model, prompt, NEW_TOKENS) == _hf_greedy(hf, prompt)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_cpu_operator_takes_every_familys_layers_and_gives_transformers_tokens(
        tmp_path_factory, sp_model_path, references, vocab, family):
    """The one-call step computes a Llama's layer and every family's switches (Qwen's parts of a
    head, Gemma's GeGLU, scaled embedding, output norms, windows, scale and soft caps, each
    layer's rotary table): fused as an engine fuses them, the greedy tokens are transformers'."""
    if not cpu_kernels.load():
        pytest.skip(f"the CPU operator could not be built here: {cpu_kernels.failure()}")
    hf = references[family]
    loaded = load_model(_saved(hf, tmp_path_factory.mktemp(family) / "hf", sp_model_path), device="cpu",
                        dtype="float32")
    assert cpu_decode.operator_gaps(loaded.args) == []
    assert cpu_decode.supports(loaded.model)
    loaded.model.fuse_projections()
    prompt = _prompt(vocab, seed=4)
    with torch.inference_mode():
        assert cpu_decode.takes_rows(loaded.model, PagedKVCache.for_model(loaded.args, num_pages=2, page_size=8))
    assert cached_greedy(loaded.model, prompt, NEW_TOKENS) == _hf_greedy(hf, prompt)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_the_operators_logits_are_the_layers_past_gemmas_windows(tmp_path, sp_model_path, vocab, family):
    """Every token of a prompt longer than the window, through ``PagedDecoder`` one step each over
    a dense cache's row (one page: ``PagedKVCache.of_row``) and in chunks of rows over pages out of
    order (the windows starting inside them), against the layers: the same logits. Gemma 2's caps
    are set low enough to bite."""
    if not cpu_kernels.load():
        pytest.skip(f"the CPU operator could not be built here: {cpu_kernels.failure()}")
    caps = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0) if family == "gemma2" else {}
    hf = hf_family_model(family, vocab, seed=7, **caps)
    loaded = load_model(_saved(hf, tmp_path / "hf", sp_model_path), device="cpu", dtype="float32")
    model = loaded.model
    model.fuse_projections()
    ids = _prompt(vocab, seed=8)[0].tolist()
    page, chunk = 8, 6
    dense = [KVCache.for_model(loaded.args, 1, max_seq_len=PROMPT_LEN) for _ in range(2)]
    paged = PagedKVCache.for_model(loaded.args, num_pages=PROMPT_LEN // page + 1, page_size=page)
    table = list(range(PROMPT_LEN // page, 0, -1))
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(dense[0])) and cpu_decode.takes_rows(model, paged)
        got = [decode_one(model, t, p, dense[0])[0] for p, t in enumerate(ids)]
        rows = cpu_decode.PagedDecoder(model, paged)
        chunked = [rows(ids[p:p + chunk], list(range(p, min(p + chunk, PROMPT_LEN))), [table] * len(ids[p:p + chunk]))
                   for p in range(0, PROMPT_LEN, chunk)]
        want = [model(torch.tensor([[t]]), torch.tensor([[p]]), dense[1])[0] for p, t in enumerate(ids)]
    want = torch.cat(want)
    assert (torch.cat(got) - want).abs().max().item() <= 1e-4
    assert (torch.cat(chunked) - want).abs().max().item() <= 1e-4


def _gguf_reference(family: str, vocab: int, seed: int):
    """A reference whose every setting a GGUF file keeps. The file keeps no query_pre_attn_scalar:
    llama.cpp takes a Gemma's head width, as every Gemma but the 27B ones has it."""
    extra = {"query_pre_attn_scalar": 32} if family.startswith("gemma") else {}
    return hf_family_model(family, vocab, seed=seed, **extra)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gguf_file_as_the_converter_writes_it_gives_transformers_tokens(tmp_path, sp_model_path, references,
                                                                         vocab, family):
    hf = references[family] if not family.startswith("gemma") else _gguf_reference(family, vocab, len(family))
    path = write_family_gguf(tmp_path / f"{family}.gguf", hf, family, sp_model_path)
    loaded = load_model(path, device="cpu", dtype="float32")
    assert loaded.args.family == ("llama" if family == "mistral" else family)
    prompt = _prompt(vocab, seed=2)
    with torch.inference_mode():
        want = hf(prompt).logits.float()
        got = loaded.model(prompt)
    if family == "mistral":  # llama.cpp runs Mistral's files as Llama's, with no window: the same within it
        got, want = got[:, :WINDOW], want[:, :WINDOW]
    assert (got - want).abs().max().item() <= 1e-4
    if family != "mistral":
        assert cached_greedy(loaded.model, prompt, NEW_TOKENS) == _hf_greedy(hf, prompt)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_q8_0_file_on_packed_blocks_gives_the_tokens_of_its_own_weights(tmp_path, sp_model_path, vocab, family):
    """The file's Q8_0 blocks as they lie (the CPU's default for a GGUF file), q/k rows put in pairs
    and Phi-3's fused rows split, against transformers holding the values the blocks hold."""
    hf = _gguf_reference(family, vocab, seed=3)
    path = write_family_gguf(tmp_path / f"{family}.gguf", hf, family, sp_model_path, qtype=T.Q8_0)
    round_trip(hf, T.Q8_0)
    loaded = load_model(path, device="cpu")
    assert "packed q8_0" in loaded.weights().format
    expanded = load_model(path, device="cpu", dtype="float32")
    prompt = _prompt(vocab, seed=3)
    with torch.inference_mode():
        assert (expanded.model(prompt) - hf(prompt).logits.float()).abs().max().item() <= 1e-4
    # Packed products round each input row to 8 bits, as llama.cpp's do: fed transformers' ids,
    # the packed model picks transformers' next id wherever that was no near tie.
    want = _hf_greedy(hf, prompt, 16)
    with torch.inference_mode():
        cache = KVCache.for_model(loaded.args, 1, max_seq_len=PROMPT_LEN + 16)
        logits = loaded.model(prompt, torch.arange(PROMPT_LEN).unsqueeze(0), cache, last_only=True)[0, -1]
        reference = hf(torch.tensor([prompt[0].tolist() + want])).logits[0, PROMPT_LEN - 1:].float()
        compared = 0
        for step, token in enumerate(want):
            top = reference[step].topk(2).values
            if float(top[0] - top[1]) >= NEAR_TIE:
                compared += 1
                assert int(logits.argmax()) == token, step
            logits = decode_one(loaded.model, token, PROMPT_LEN + step, cache)[0, -1]
    assert compared >= 8


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gemma3", "mistral"])
def test_eight_jobs_on_the_scheduler_give_each_prompts_transformers_tokens(
        tmp_path_factory, sp_model_path, references, vocab, family):
    """Eight prompts of different lengths at once over the page pool (windows crossing pages)."""
    hf = references[family]
    loaded = load_model(_saved(hf, tmp_path_factory.mktemp(family) / "hf", sp_model_path), device="cpu",
                        dtype="float32")
    tokenizer = SentencePieceTokenizer(sp_model_path)
    prompts = [_prompt(vocab, seed=10 + i, n=12 + 7 * i) for i in range(8)]
    requests = [Request(tuple(p[0].tolist()), sampling=GREEDY, max_tokens=12, request_id=f"j{i}")
                for i, p in enumerate(prompts)]

    async def main():
        out = {}
        async with Scheduler(loaded.model, tokenizer, SchedulerOptions(max_batch=8, page_size=8)) as scheduler:
            streams = [scheduler.submit(r) for r in requests]

            async def consume(stream):
                async for _ in stream:
                    pass
                out[stream.request_id] = stream.completion().token_ids

            async with anyio.create_task_group() as tg:
                for stream in streams:
                    tg.start_soon(consume, stream)
        return out

    got = anyio.run(main)
    for i, prompt in enumerate(prompts):
        assert list(got[f"j{i}"]) == _hf_greedy(hf, prompt, 12), f"job {i}"


# -- what a family's file must hold ------------------------------------------------------------------


def test_a_family_file_missing_a_tensor_its_family_needs_is_named(tmp_path, sp_model_path, references):
    broken = write_family_gguf(tmp_path / "broken.gguf", references["qwen2"], "qwen2", sp_model_path,
                               leave_out=("blk.1.attn_k.bias",))
    with pytest.raises(ModelLoadError) as e:
        load_model(broken, device="cpu")
    assert str(e.value) == "broken.gguf: missing tensor 'layers.1.attention.bk'"


def test_a_fused_tensor_of_the_wrong_size_is_named(tmp_path, sp_model_path, vocab):
    hf = hf_family_model("phi3", vocab, seed=4)
    with torch.no_grad():
        layer = hf.model.layers[0].self_attn
        layer.qkv_proj.weight = torch.nn.Parameter(layer.qkv_proj.weight[:-8].clone())
    out = tmp_path / "phi3"
    hf.save_pretrained(out)
    (out / "tokenizer.model").write_bytes(sp_model_path.read_bytes())
    with pytest.raises(ModelLoadError) as e:
        load_model(out, device="cpu")
    assert str(e.value) == ("model.safetensors: tensor 'layers.0.attention.wqkv.weight' has 120 rows, "
                            "expected 128 (64 + 32 + 32)")


def test_a_vision_model_and_an_unknown_family_are_refused_by_name(tmp_path, sp_model_path, references):
    import json

    out = _saved(references["qwen2"], tmp_path / "q", sp_model_path)
    config = json.loads((out / "config.json").read_text())
    for model_type, expected in (
            ("gemma3", "config.json: a Gemma 3 model with a vision tower is not supported"),
            ("falcon", "config.json: model_type 'falcon' is not supported (expected one of llama, mistral, "
                       "qwen2, qwen3, gemma2, gemma3_text, gemma3, phi3, bert)")):
        (out / "config.json").write_text(json.dumps({**config, "model_type": model_type, "vision_config": {}}))
        with pytest.raises(ModelLoadError) as e:
            load_model(out, device="cpu")
        assert str(e.value).startswith(expected)


def test_a_window_the_context_never_passes_is_the_model_without_one(tmp_path, sp_model_path, vocab):
    """Phi-3's 128k files set a window larger than their context: it changes nothing, exactly."""
    hf = hf_family_model("mistral", vocab, seed=5, sliding_window=4096)
    loaded = load_model(_saved(hf, tmp_path / "m", sp_model_path), device="cpu", dtype="float32")
    assert loaded.args.sliding_window == 4096 and loaded.args.max_seq_len == 2048
    assert loaded.args.attention_rule(0).plain
    prompt = _prompt(vocab, seed=6)
    with torch.inference_mode():
        assert (loaded.model(prompt) - hf(prompt).logits.float()).abs().max().item() <= 1e-4
