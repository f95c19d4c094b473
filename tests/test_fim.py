"""Fill-in-the-middle: ``suffix`` on /v1/completions, llama-server's /infill and ``--suffix``, on a tiny
random model whose byte-level vocabulary has Qwen2.5-Coder's FIM specials.

Every answer is checked against the same model given the FIM prompt built here by hand, as token
ids from the ``tokenizers`` library itself, without ``suffix``: greedy, the two are the same text.
The specials' output rows are zero, so a greedy reply never ends on its own unless a test biases
it to; one server serves the module. FIM ids read from GGUF metadata are checked on vocabulary-only
files.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import httpx
import openai
import pytest
import torch

from builders import random_model, tiny_args
from builders_formats import write_hf_checkpoint
from builders_gguf import add_bpe_vocab
from cli_support import build_tiny_model, json_result, run_cli
from serve_support import WAIT_S, start_server, stop_server

# Qwen2.5-Coder's specials, in its order.
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
            "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def greet(name):\n    print(f'hello {name}')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nfor line in sys.stdin:\n    print(line.strip())\n",
    "# a comment, then numbers 0123456789 and symbols ()[]{}<>|=+-*/%,.:;'\"\\ \t\n",
]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
N = 16
GREEDY = {"temperature": 0.0, "max_tokens": N}
# llama.vim's request (autoload/llama.vim, llama#fim), its extra context one file.
EXTRA = [{"text": "class Point:\n    pass\n", "time": [1733000000, 1], "filename": "geometry.py"}]
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def vim_payload(**changes) -> dict:
    payload = {"input_prefix": "import os\n", "input_suffix": "\n    return a + b\n", "input_extra": EXTRA,
               "prompt": "def add(", "n_predict": N, "n_indent": 0, "top_k": 40, "top_p": 0.99, "temperature": 0.0,
               "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
               "t_max_prompt_ms": 500, "t_max_predict_ms": 1500, "response_fields": VIM_FIELDS}
    payload.update(changes)
    return payload


def train_tokenizer(specials: tuple[str, ...]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def coder(tmp_path_factory) -> Path:
    """A Hugging Face folder: the tokenizer (no bos, as Qwen's) and a random Llama that never
    picks a special token (their output rows are zero; the others' random logits are well above)."""
    out = tmp_path_factory.mktemp("coder")
    tok = train_tokenizer(SPECIALS)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    model = random_model(tiny_args(tok.get_vocab_size(), max_seq_len=1024), seed=11)
    with torch.no_grad():
        model.output.weight[[tok.token_to_id(s) for s in SPECIALS]] = 0.0
    write_hf_checkpoint(model, out)
    return out


@pytest.fixture(scope="module")
def raw(coder):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(coder / "tokenizer.json"))
    tok.encode_special_tokens = True  # text is text: a special's name in it is not the special
    return tok


@pytest.fixture(scope="module")
def server(coder):
    s = start_server(coder, "--template", "none", "--max-batch", "2")
    yield s
    assert stop_server(s) == 0, s.log()


def ids_of(raw, *parts) -> list[int]:
    """Ids by hand: a special by its name, anything else as text."""
    out = []
    for part in parts:
        special = raw.token_to_id(part) if part in SPECIALS else None
        out += [special] if special is not None else raw.encode(part, add_special_tokens=False).ids
    return out


def by_ids(server, ids: list[int], **settings) -> openai.types.Completion:
    return server.client().completions.create(model="coder", prompt=ids, **{**GREEDY, **settings})


# -- the prompt, in this process ---------------------------------------------------------------------


def test_the_prompt_is_the_models_order_with_other_files_first_and_special_names_stay_text(coder, raw):
    from llama_chat.inference.fim import Infill, RepoFile, fill_in_the_middle
    from llama_chat.model.tokenizers.loading import load_tokenizer

    tokenizer = load_tokenizer(coder)
    plain = fill_in_the_middle(tokenizer, Infill("x = 1\n<|fim_middle|>", "y"))
    assert list(plain.ids) == ids_of(raw, "<|fim_prefix|>", "x = 1\n<|fim_middle|>", "<|fim_suffix|>", "y",
                                     "<|fim_middle|>")
    assert set(plain.stop_ids) == {raw.token_to_id("<|fim_pad|>"), raw.token_to_id("<|file_sep|>")}
    repo = fill_in_the_middle(tokenizer, Infill("a", "b", "c", (RepoFile("u.py", "x\n"), RepoFile("v.py", "y\n"))))
    assert list(repo.ids) == ids_of(raw, "<|repo_name|>", "myproject\n", "<|file_sep|>", "u.py\n", "x\n",
                                    "<|file_sep|>", "v.py\n", "y\n", "<|file_sep|>", "filename\n",
                                    "<|fim_prefix|>", "a", "c", "<|fim_suffix|>", "b", "<|fim_middle|>")


def test_past_its_room_the_prompt_keeps_what_is_nearest_the_cursor(coder, raw):
    from llama_chat.inference.fim import Infill, RepoFile, fill_in_the_middle
    from llama_chat.model.tokenizers.loading import load_tokenizer

    tokenizer = load_tokenizer(coder)
    prefix, suffix = "import os\nimport sys\n" * 4, "\nprint(line)\n" * 4
    infill = Infill(prefix, suffix, files=(RepoFile("u.py", "def greet(name):\n" * 8),))
    whole = fill_in_the_middle(tokenizer, infill).ids
    pre, suf = ids_of(raw, prefix), ids_of(raw, suffix)
    # The other files go first, from their start.
    cut = fill_in_the_middle(tokenizer, infill, room=len(whole) - 5).ids
    assert len(cut) == len(whole) - 5 and cut == whole[5:]
    # Then the prefix's start, then the suffix's end.
    room = len(pre) + len(suf) + 3 - 4
    cut = list(fill_in_the_middle(tokenizer, infill, room=room).ids)
    pre_id, suf_id, mid_id = ids_of(raw, "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
    assert cut == [pre_id, *pre[4:], suf_id, *suf, mid_id]
    cut = list(fill_in_the_middle(tokenizer, infill, room=len(suf) + 3 - 2).ids)
    assert cut == [pre_id, suf_id, *suf[:-2], mid_id]


def write_vocab_file(path: Path, specials: tuple[str, ...], metadata: dict[str, str]) -> Path:
    """A vocabulary-only GGUF (as llama.cpp's test vocabularies are) with FIM ids by role, each
    the id of the special ``metadata`` names."""
    tok = train_tokenizer(specials)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    add_bpe_vocab(writer, tok, "qwen2", eos="<|endoftext|>", add_bos=False)
    for role, name in metadata.items():
        writer.add_uint32(f"tokenizer.ggml.{role}_token_id", tok.token_to_id(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fim_tokens_are_read_from_gguf_metadata_whatever_their_names(tmp_path):
    from llama_chat.inference.fim import NoFimTokens, find_fim_tokens
    from llama_chat.model.formats.gguf import open_gguf
    from llama_chat.model.tokenizers.gguf import load_gguf_tokenizer

    specials = ("<|endoftext|>", "<A>", "<B>", "<C>", "<D>", "<E>")
    roles = {"fim_pre": "<A>", "fim_suf": "<B>", "fim_mid": "<C>", "fim_pad": "<D>", "fim_sep": "<E>"}
    tokenizer = load_gguf_tokenizer(open_gguf(write_vocab_file(tmp_path / "named.gguf", specials, roles)))
    ids = {name: tokenizer.special_tokens[name] for name in specials}
    tokens = find_fim_tokens(tokenizer)
    assert (tokens.pre, tokens.suf, tokens.mid, tokens.pad, tokens.rep, tokens.sep) == (
        ids["<A>"], ids["<B>"], ids["<C>"], ids["<D>"], None, ids["<E>"])
    assert set(tokens.stop_ids) == {ids["<D>"], ids["<E>"]}
    # The same names without the metadata are nobody's FIM tokens; a file with only some lacks the rest.
    bare = load_gguf_tokenizer(open_gguf(write_vocab_file(tmp_path / "bare.gguf", specials, {})))
    whole = r"^this model has no fill-in-the-middle tokens \(fim_pre, fim_suf, fim_mid\)$"
    with pytest.raises(NoFimTokens, match=whole):
        find_fim_tokens(bare)
    part = load_gguf_tokenizer(open_gguf(write_vocab_file(tmp_path / "part.gguf", specials, {"fim_pre": "<A>"})))
    with pytest.raises(NoFimTokens, match=r"\(fim_suf, fim_mid\)$"):
        find_fim_tokens(part)
    # Files converted before the fim_* keys name the first three prefix, suffix and middle (CodeLlama's).
    old = {"prefix": "<A>", "suffix": "<B>", "middle": "<C>"}
    tokens = find_fim_tokens(load_gguf_tokenizer(open_gguf(write_vocab_file(tmp_path / "old.gguf", specials, old))))
    assert (tokens.pre, tokens.suf, tokens.mid, tokens.pad) == (ids["<A>"], ids["<B>"], ids["<C>"], None)


# -- the server --------------------------------------------------------------------------------------


def test_a_completion_with_a_suffix_is_the_hand_built_fim_prompts_completion(server, raw):
    client = server.client()
    fim = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    hand = ids_of(raw, "<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>")
    plain = by_ids(server, hand)
    assert fim.choices[0].text.encode() == plain.choices[0].text.encode()
    assert fim.choices[0].text and fim.usage.completion_tokens == N
    assert fim.usage.prompt_tokens == len(hand)
    # Streamed: the same text in pieces.
    pieces = client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in pieces) == fim.choices[0].text
    # Without the suffix it is a plain completion of the prefix, a different prompt.
    assert client.completions.create(model="coder", prompt=PREFIX, **GREEDY).usage.prompt_tokens != len(hand)


def test_ollamas_generate_with_a_suffix_is_the_same_middle(server):
    import ollama

    fim = server.client().completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    generate = ollama.Client(host=server.url, timeout=WAIT_S).generate
    options = {"temperature": 0, "num_predict": N}
    whole = generate(model="coder", prompt=PREFIX, suffix=SUFFIX, stream=False, options=options)
    assert whole.response == fim.choices[0].text and whole.done
    assert (whole.prompt_eval_count, whole.eval_count) == (fim.usage.prompt_tokens, fim.usage.completion_tokens)
    parts = generate(model="coder", prompt=PREFIX, suffix=SUFFIX, stream=True, options=options)
    assert "".join(part.response for part in parts) == whole.response
    assert "insert" in ollama.Client(host=server.url, timeout=WAIT_S).show(whole.model).capabilities


def test_the_fim_pad_and_the_file_separator_end_a_middle_and_nothing_else(server, raw):
    """Biased to the pad (or the next file), the middle ends there; the same prompt sent as ids
    without the suffix is no fill-in-the-middle, and the pad does not end it."""
    for name in ("<|fim_pad|>", "<|file_sep|>"):
        bias = {"logit_bias": {str(raw.token_to_id(name)): 100}}
        fim = server.client().completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, **GREEDY,
                                                 extra_body=bias)
        assert (fim.choices[0].finish_reason, fim.choices[0].text, fim.usage.completion_tokens) == ("stop", "", 1)
        hand = by_ids(server, ids_of(raw, "<|fim_prefix|>", PREFIX, "<|fim_suffix|>", SUFFIX, "<|fim_middle|>"),
                      extra_body=bias)
        assert (hand.choices[0].finish_reason, hand.usage.completion_tokens) == ("length", N)


def test_infill_with_llama_vims_payload_is_the_hand_built_repository_prompts_completion(server, raw):
    payload = vim_payload()
    response = httpx.post(f"{server.url}/infill", json=payload, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    body = response.json()
    hand = ids_of(raw, "<|repo_name|>", "myproject\n", "<|file_sep|>", "geometry.py\n", EXTRA[0]["text"],
                  "<|file_sep|>", "filename\n", "<|fim_prefix|>", payload["input_prefix"], payload["prompt"],
                  "<|fim_suffix|>", payload["input_suffix"], "<|fim_middle|>")
    expected = by_ids(server, hand).choices[0].text
    assert body["content"] == expected and expected
    # Only the fields asked for, by path; llama-server's "truncated" is not said here.
    assert set(body) == set(VIM_FIELDS) - {"truncated"}
    assert body["timings/predicted_n"] == N and body["timings/prompt_n"] + body["tokens_cached"] == len(hand)
    # The whole object, and the same streamed as llama-server's events.
    whole = httpx.post(f"{server.url}/infill", json=vim_payload(response_fields=None), timeout=WAIT_S).json()
    assert whole["content"] == expected and whole["stop"] is True and whole["stop_type"] == "limit"
    assert (whole["tokens_predicted"], whole["tokens_evaluated"]) == (N, len(hand))
    events = []
    with httpx.stream("POST", f"{server.url}/infill", json=vim_payload(stream=True, response_fields=None),
                      timeout=WAIT_S) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        for line in streamed.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    assert "".join(e["content"] for e in events) == expected
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == N


def test_infill_takes_llama_vims_context_request_and_refuses_bad_input(server):
    # Sent ahead with n_predict 0, to have the other files read.
    ahead = vim_payload(input_prefix="", input_suffix="", prompt="", n_predict=0, samplers=[], response_fields=[""])
    response = httpx.post(f"{server.url}/infill", json=ahead, timeout=WAIT_S)
    assert response.status_code == 200 and response.json() == {}
    for change, field in (({"input_extra": {"text": "x"}}, "input_extra"),
                          ({"input_extra": [{"filename": "a"}]}, "input_extra"),
                          ({"input_prefix": 3}, "input_prefix"), ({"mirostat": 2}, "mirostat"),
                          ({"top_k": -5}, "top_k")):
        bad = httpx.post(f"{server.url}/infill", json=vim_payload(**change), timeout=WAIT_S)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    # Nothing disturbed.
    assert httpx.post(f"{server.url}/infill", json=vim_payload(), timeout=WAIT_S).status_code == 200
    with pytest.raises(openai.BadRequestError, match="suffix needs the prompt as text"):
        server.client().completions.create(model="coder", prompt=[1, 2, 3], suffix="x", **GREEDY)


def test_suffix_on_the_command_line_is_the_servers_answer(server, coder, tmp_path):
    expected = server.client().completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX, **GREEDY)
    args = ("-m", str(coder), "--no-stdin", "-t", "0", "-n", str(N), "--json")
    result = json_result(run_cli(*args, "-p", PREFIX, "--suffix", SUFFIX))
    assert result["text"] == expected.choices[0].text
    assert (result["prompt_tokens"], result["finish_reason"]) == (expected.usage.prompt_tokens, "max_tokens")
    suffix_file = tmp_path / "after.py"
    suffix_file.write_text(SUFFIX)
    assert json_result(run_cli(*args, "-p", PREFIX, "--suffix-file", str(suffix_file)))["text"] == result["text"]


def test_suffix_goes_with_one_prompt_of_a_model_here(coder, tmp_path):
    """Each a usage error in one line, before any model is loaded."""
    model = ("-m", str(coder), "--no-stdin")
    for args, line in (
            (("-p", "x", "--suffix", "y", "--suffix-file", "f"), "--suffix and --suffix-file: give one of them"),
            (("-p", "x", "--suffix", "y", "--chat"), "--suffix fills in the middle of a one-shot prompt; it cannot "
                                                     "be used with --chat"),
            (("-p", "x", "--suffix-file", "f", "-s", "Be brief."), "--suffix-file fills in the middle of a one-shot "
                                                                   "prompt; it cannot be used with --system"),
            (("--suffix", "y"), "--suffix needs a prompt, the code before the cursor: pass --prompt TEXT, --file "
                                "FILE or pipe it on stdin"),
            (("-p", "x", "--suffix-file", str(tmp_path / "missing.py")),
             f"--suffix-file {tmp_path / 'missing.py'}: cannot read it (No such file or directory)")):
        proc = run_cli(*model, *args)
        lines = proc.stderr.decode().strip().splitlines()
        assert proc.returncode == 2 and lines == [f"llama-chat: error: {line}"], proc.stderr


# -- a model without FIM tokens ----------------------------------------------------------------------


def test_a_model_without_fim_tokens_is_one_line_and_a_400(tmp_path):
    tiny = build_tiny_model(tmp_path, max_seq_len=256)
    message = "this model has no fill-in-the-middle tokens (fim_pre, fim_suf, fim_mid)"
    proc = run_cli("-m", str(tiny.path), "--no-stdin", "-p", "def f(", "--suffix", "):", "-n", "4")
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and lines == [f"llama-chat: error: {message}"], proc.stderr
    s = start_server(tiny.path)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            s.client().completions.create(model="tiny", prompt="def f(", suffix="):", max_tokens=4)
        assert refused.value.status_code == 400 and refused.value.body["message"] == message
        infill = httpx.post(f"{s.url}/infill", json={"input_prefix": "def f(", "input_suffix": "):"}, timeout=WAIT_S)
        assert infill.status_code == 400 and infill.json()["error"]["message"] == message
        # Nothing else disturbed: a plain completion, and an empty suffix is one.
        assert s.client().completions.create(model="tiny", prompt="def f(", suffix="", max_tokens=4).choices[0].text
    finally:
        assert stop_server(s) == 0, s.log()
