"""Structured output (``ml/grammars.py``, ``ml/constraints.py``): JSON schemas, patterns and
grammars as a logits processor, on every path that generates.

Models have random weights, so only the constraint can make a reply valid: every reply must parse
and validate against its schema (``jsonschema``) or match its pattern in full, through the engine
(the one-shot command's path), the scheduler (``--batch`` and the chat), beam search and the
command itself. Greedy decoding with a constraint must pick what it picks without one wherever the
constraint allows that token. Sampled runs cover 50 seeds per case through the scheduler.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import anyio
import pytest
import torch

import tokenizer_builders as tb
from builders import random_model, tiny_args
from builders_formats import hf_config, hf_state
from builders_gguf import write_gguf
from llama_chat.inference.beam import BeamLimits, BeamSearch
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import GenerationState, Request, RequestError, check_constraint, stop_ids_of
from llama_chat.ml.constraints import Constraints, GrammarMask, Vocabulary
from llama_chat.ml.controls import BeamParams, ControlError, SamplingParams
from llama_chat.ml.grammars import Constraint, format_constraint
from llama_chat.ml.processors import TokenHistory, make_controls
from llama_chat.model.loader import load_model
from llama_chat.model.stores import default_model_dir
from llama_chat.model.tokenizers.loading import load_tokenizer

jsonschema = pytest.importorskip("jsonschema")

SEEDS = range(50)
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0, top_p=1.0)
PROMPT_TEXT = "Once upon a time"

SCHEMAS = {
    "flat object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                       "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
    "nested arrays": {
        "type": "object",
        "properties": {"grid": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"type": "array", "maxItems": 3,
                                          "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["grid"], "additionalProperties": False},
    "enums": {
        "type": "object",
        "properties": {"animal": {"enum": ["cat", "dog", "fox"]}, "size": {"enum": ["S", "M", "L", 1, None]}},
        "required": ["animal", "size"], "additionalProperties": False},
    "bounded numbers": {
        "type": "object",
        "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
                       "t": {"type": "number", "exclusiveMinimum": -40, "maximum": 50},
                       "n": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["p", "t", "n"], "additionalProperties": False},
    "required and optional fields": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                       "note": {"type": "string", "maxLength": 8},
                       "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}}},
        "required": ["id"], "additionalProperties": False},
}
PATTERNS = {
    "date": r"\d{4}-\d{2}-\d{2}",
    "e-mail": r"[a-z0-9._]{1,12}@[a-z0-9]{1,10}\.(com|org|net)",
}


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def check_pattern(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text, re.ASCII), (pattern, text)


def constraint_of(case: str) -> tuple[Constraint, callable]:
    """A case's constraint and the check of a reply against it."""
    if case in SCHEMAS:
        schema = SCHEMAS[case]
        return Constraint.json_schema(schema), lambda text: check_json(text, schema)
    pattern = PATTERNS[case]
    return Constraint.regex(pattern), lambda text: check_pattern(text, pattern)


CASES = [*SCHEMAS, *PATTERNS]


@pytest.fixture(scope="module")
def tokenizer(sp_model_path):
    return load_tokenizer(sp_model_path.parent)


@pytest.fixture(scope="module")
def model(tokenizer):
    return random_model(tiny_args(tokenizer.vocab_size, max_seq_len=512), seed=1)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Scheduler(model, tokenizer, SchedulerOptions(max_batch=1))


def prompt_ids(tokenizer, text: str = PROMPT_TEXT) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, bos=True))


async def run_jobs(scheduler: Scheduler, requests: list[Request]):
    """Every request through the scheduler at once; their completions in the same order."""
    done = {}

    async def consume(request):
        async with scheduler.submit(request) as stream:
            async for _ in stream:
                pass
        done[request.request_id] = stream.completion()

    async with scheduler:
        async with anyio.create_task_group() as tg:
            for request in requests:
                tg.start_soon(consume, request)
    return [done[r.request_id] for r in requests]


# -- the constraint as asked: checked before any model -----------------------------------------------


@pytest.mark.parametrize("kind, source, reason", [
    ("json_schema", "{not json", "is not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
    ("json_schema", '{"type": "integer", "minimum": "x"}', "minimum"),
    ("json_schema", '{"$ref": "#/defs/missing"}', "does not exist"),
    ("regex", "a(b", "unclosed group"),
    ("regex", "  ", "must not be empty"),
    ("grammar", "start: foo", 'unknown name: "foo"'),
    ("grammar", 'root ::= "a" | b', "Rule 'b' not found"),
])
def test_bad_schemas_patterns_and_grammars_are_one_line_errors(kind, source, reason):
    with pytest.raises(ControlError) as info:
        Constraint(kind, source)
    message = str(info.value)
    assert message.startswith(kind) and reason in message and "\n" not in message, message


def test_constraints_are_checked_without_torch():
    code = ("import sys; from llama_chat.ml.grammars import Constraint; "
            "Constraint.json_schema({'type': 'object'}); Constraint.regex('a+'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_equal_constraints_compare_equal_and_formats_are_named():
    a = Constraint("json_schema", '{"type": "object",\n "required": []}')
    assert a == Constraint.json_schema({"type": "object", "required": []})
    assert hash(a) == hash(Constraint(a.kind, a.source))
    assert format_constraint("JSON") == Constraint.any_json() and format_constraint("none") is None
    with pytest.raises(ControlError, match="format must be one of json, none"):
        format_constraint("yaml")


# -- the vocabulary: every backend's own token bytes -----------------------------------------------


@pytest.fixture(scope="module")
def backends(tmp_path_factory, sp_model_path):
    """One tokenizer per backend, by name."""
    root = tmp_path_factory.mktemp("backends")
    sp_llama = tb.train_llama_sentencepiece(root / "sp")
    (root / "llama2c").mkdir()
    tb.write_llama2c_tokenizer(root / "llama2c" / "tokenizer.bin", sp_llama)
    ranks = tb.write_tiktoken_file(root / "tiktoken")
    vocab = load_tokenizer(ranks.parent).vocab_size
    weights = random_model(tiny_args(vocab, max_seq_len=256), seed=4)
    gguf_file = write_gguf(root / "tiny.gguf", hf_state(weights), hf_config(weights), tiktoken_file=ranks)
    return {
        "sentencepiece (shipped model)": load_tokenizer(default_model_dir()),
        "sentencepiece": load_tokenizer(sp_model_path.parent),
        "tiktoken": load_tokenizer(ranks.parent),
        "tokenizer.json byte-level": load_tokenizer(tb.write_bytelevel_tokenizer_json(root / "bytelevel").parent),
        "tokenizer.json metaspace": load_tokenizer(
            tb.write_metaspace_tokenizer_json(root / "metaspace", sp_llama).parent),
        "llama2.c tokenizer.bin": load_tokenizer(root / "llama2c"),
        "GGUF (tiktoken vocabulary)": load_model(gguf_file, device="cpu").tokenizer,
    }


def test_the_vocabulary_is_the_tokenizers_own_bytes(backends):
    for name, tok in backends.items():
        stops = stop_ids_of(tok)
        vocabulary = Vocabulary.of(tok, stops)
        assert vocabulary.size == tok.vocab_size and set(vocabulary.ll.eos_tokens) == stops, name
        for i in range(tok.vocab_size):
            want = b"" if i in stops else tok.token_bytes(i)
            assert vocabulary.tokens[i] == want, (name, i)
            if want and not want.startswith(b"\xff"):  # 0xFF, never in UTF-8, marks llguidance's specials
                assert vocabulary.ll.decode_bytes([i]) == want, (name, i)


MULTIBYTE = {"type": "object",
             "properties": {"city": {"enum": ["東京", "Zürich", "Привет", "café 🐱"]},
                            "word": {"type": "string", "maxLength": 4}},
             "required": ["city", "word"], "additionalProperties": False}


@pytest.mark.parametrize("name", ["sentencepiece (shipped model)", "sentencepiece", "tiktoken",
                                  "tokenizer.json byte-level", "tokenizer.json metaspace", "llama2.c tokenizer.bin",
                                  "GGUF (tiktoken vocabulary)"])
def test_every_backend_spells_multibyte_text_validly(backends, name):
    tok = backends[name]
    model = random_model(tiny_args(tok.vocab_size, max_seq_len=256), seed=2)
    engine = Scheduler(model, tok, SchedulerOptions(max_batch=1))
    constraint = Constraint.json_schema(MULTIBYTE)
    partial = 0
    for seed in range(8):
        done = engine.generate(Request(prompt_ids(tok), sampling=SAMPLED, seed=seed, max_tokens=120,
                                       constraint=constraint))
        assert done.finish_reason in (GenerationState.STOP_GRAMMAR, GenerationState.EOS), (seed, done.text)
        check_json(done.text.strip(), MULTIBYTE)
        partial += sum(1 for t in done.token_ids if _is_partial_utf8(tok.token_bytes(t)))
    if name.startswith(("tiktoken", "GGUF")):
        # Byte-level tokens that are pieces of a character: the mask lets them through and the
        # characters they spell come out whole.
        assert partial > 0


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


# -- the processor: one matcher per row, following the history ----------------------------------------


@pytest.fixture(scope="module")
def constraints(tokenizer):
    return Constraints(tokenizer, stop_ids_of(tokenizer))


def allowed(mask: GrammarMask, history: TokenHistory, vocab: int) -> torch.Tensor:
    return torch.isfinite(mask(history, torch.zeros(history.rows, vocab)))


def token_of(tokenizer, data: bytes) -> int:
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == data)


def test_forked_rows_copy_their_matcher_and_go_on_alone(constraints, tokenizer):
    mask = constraints.processor(Constraint.regex("(ab|ac)d"))
    vocab = tokenizer.vocab_size
    a, b, c, d = (token_of(tokenizer, x) for x in (b"a", b"b", b"c", b"d"))
    history = TokenHistory([[1, 5], [1, 6]], vocab_size=vocab)
    first = allowed(mask, history, vocab)
    assert torch.equal(first[0], first[1]) and first[0, a] and not first[0, b]
    history.append([a, b])  # row 1 takes a token its grammar refuses: it cannot go on
    assert not mask.stopped(0) and mask.stopped(1)
    history.reorder([0, 0])  # row 0's state forks into both rows
    forked = allowed(mask, history, vocab)
    assert torch.equal(forked[0], forked[1]) and forked[0, b] and forked[0, c] and not forked[0, d]
    history.append([b, c])  # each copy goes its own way
    assert allowed(mask, history, vocab)[:, d].all()
    history.append([d, d])
    assert mask.stopped(0) and mask.stopped(1)
    history.add_rows([[1, 7]])
    assert torch.equal(allowed(mask, history, vocab)[2], first[0])  # a new row starts the grammar again


@pytest.mark.parametrize("case", ["flat object", "date"])
def test_masks_ahead_equal_masks_made_when_asked(constraints, tokenizer, case):
    constraint, _ = constraint_of(case)
    vocab = tokenizer.vocab_size
    runs = []
    for ahead in (True, False):
        mask = GrammarMask(constraints.compile(constraint), ahead=ahead)
        history = TokenHistory([[1]], vocab_size=vocab)
        seen = []
        for _ in range(40):
            row = allowed(mask, history, vocab)[0]
            seen.append(row)
            if mask.stopped(0) or not row.any():
                break
            choices = row.nonzero().flatten()
            history.append([int(choices[len(seen) * 7919 % len(choices)])])
        runs.append(seen)
    assert len(runs[0]) == len(runs[1]) > 3 and all(torch.equal(a, b) for a, b in zip(*runs))


def test_would_stop_asks_without_taking(constraints, tokenizer):
    mask = constraints.processor(Constraint.regex("ab"))
    vocab = tokenizer.vocab_size
    history = TokenHistory([[1]], vocab_size=vocab)
    a, b = token_of(tokenizer, b"a"), token_of(tokenizer, b"b")
    allowed(mask, history, vocab)
    assert not mask.would_stop(0, a) and not mask.would_stop(0, b)  # b is refused here
    history.append([a])
    allowed(mask, history, vocab)
    assert mask.would_stop(0, b) and mask.would_stop(0, b) and not mask.stopped(0)
    history.append([b])
    assert mask.stopped(0)


def test_logits_wider_than_the_vocabulary_lose_the_extra_ids(constraints, tokenizer):
    mask = constraints.processor(Constraint.any_json())
    vocab = tokenizer.vocab_size
    history = TokenHistory([[1]], vocab_size=vocab)
    out = mask(history, torch.zeros(1, vocab + 64))
    assert torch.isinf(out[0, vocab:]).all() and torch.isfinite(out[0, :vocab]).sum() >= 1


def test_the_constraint_comes_after_the_other_processors(constraints, tokenizer):
    mask = constraints.processor(Constraint.regex("[0-9]+"))
    sampler = make_controls(SamplingParams(temperature=0.0, repetition_penalty=1.3, logit_bias=((5, 50.0),)),
                           eos_ids=(2,), constraint=mask)
    assert sampler.processors[-1] is mask
    history = TokenHistory([[1, 3]], vocab_size=tokenizer.vocab_size)
    token = int(sampler(history, torch.randn(1, tokenizer.vocab_size, generator=torch.Generator().manual_seed(1)))[0])
    assert tokenizer.token_bytes(token).isdigit()


# -- every reply validates: the engine, the scheduler, beam search ------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_sampled_replies_validate_for_50_seeds(model, tokenizer, case):
    constraint, check = constraint_of(case)
    prompt = prompt_ids(tokenizer)
    scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=16))
    requests = [Request(prompt, sampling=SAMPLED, seed=seed, max_tokens=200, constraint=constraint) for seed in SEEDS]
    for seed, done in zip(SEEDS, anyio.run(run_jobs, scheduler, requests)):
        assert done.finish_reason in (GenerationState.STOP_GRAMMAR, GenerationState.EOS), (seed, done.text)
        check(done.text.strip())
    # Without the constraint the same weights and seeds write no valid reply at all.
    free = anyio.run(run_jobs, scheduler, [Request(prompt, sampling=SAMPLED, seed=seed, max_tokens=60)
                                           for seed in SEEDS[:10]])
    for done in free:
        with pytest.raises((ValueError, AssertionError, jsonschema.ValidationError)):
            check(done.text.strip())


@pytest.mark.parametrize("case", CASES)
def test_engine_replies_validate(engine, tokenizer, case):
    constraint, check = constraint_of(case)
    for seed in range(6):
        params = GREEDY if seed == 0 else SAMPLED
        done = engine.generate(Request(prompt_ids(tokenizer), sampling=params, seed=seed, max_tokens=200,
                                       constraint=constraint))
        assert done.finish_reason in (GenerationState.STOP_GRAMMAR, GenerationState.EOS), (seed, done.text)
        check(done.text.strip())


def test_engine_and_scheduler_pick_the_same_tokens(engine, model, tokenizer):
    constraint, _ = constraint_of("flat object")
    requests = [Request(prompt_ids(tokenizer), sampling=SAMPLED, seed=seed, max_tokens=200, constraint=constraint)
                for seed in range(4)]
    batched = anyio.run(run_jobs, Scheduler(model, tokenizer, SchedulerOptions(max_batch=4)), requests)
    for request, done in zip(requests, batched):
        assert engine.generate(request).token_ids == done.token_ids


@pytest.mark.parametrize("case", ["flat object", "enums", "nested arrays", "date"])
def test_beam_search_returns_only_valid_beams(engine, tokenizer, case):
    constraint, check = constraint_of(case)

    async def search(prompt):
        request = Request(prompt, sampling=GREEDY, max_tokens=160, constraint=constraint,
                          beams=BeamParams(num_beams=3, num_return=3))
        async with engine.beams(request) as run:
            async for _ in run:
                pass
        return run.completion()

    for text in ("Once upon a time", "The fox", "Hello world"):
        completion = anyio.run(search, prompt_ids(tokenizer, text))
        assert len(completion.beams) == 3
        for beam in completion.beams:
            assert beam.finish_reason in (GenerationState.STOP_GRAMMAR, GenerationState.EOS), beam
            check(beam.text.strip())


def test_sampled_beams_validate(model, tokenizer):
    constraint, check = constraint_of("enums")
    for seed in range(5):
        search = BeamSearch(model, prompt_ids(tokenizer), SAMPLED, BeamParams(num_beams=3, num_return=3),
                            limits=BeamLimits(120, GenerationState.MAX_TOKENS, time.perf_counter()),
                            stop_ids=stop_ids_of(tokenizer), seed=seed, vocab=tokenizer.vocab_size,
                            device=torch.device("cpu"), dtype=torch.float32,
                            constraint=Constraints(tokenizer, stop_ids_of(tokenizer)).processor(constraint))
        while search.prefill(64):
            pass
        while search.step():
            pass
        for beam in search.result():
            text = b"".join(tokenizer.token_bytes(t) for t in beam.token_ids if t not in search.stop_ids).decode()
            check(text.strip())


# -- the mask leaves allowed tokens alone -----------------------------------------------------------------


@pytest.fixture(scope="module")
def free_picks():
    """Steps, over every case, where the free choice was allowed (checked at the end: the
    comparison then meant something)."""
    counts = []
    yield counts
    assert sum(counts) > 0


@pytest.mark.parametrize("case", ["flat object", "enums", "date"])
def test_greedy_with_a_constraint_picks_the_free_choice_wherever_it_is_allowed(tokenizer, case, free_picks):
    constraint, _ = constraint_of(case)
    constraints = Constraints(tokenizer, stop_ids_of(tokenizer))
    for seed in range(10):
        model = random_model(tiny_args(tokenizer.vocab_size, max_seq_len=256), seed=100 + seed)
        engine = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1))
        prompt = prompt_ids(tokenizer)
        bound = engine.generate(Request(prompt, sampling=GREEDY, max_tokens=100, constraint=constraint)).token_ids
        free = engine.generate(Request(prompt, sampling=GREEDY, max_tokens=len(bound))).token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + bound]))[0, len(prompt) - 1:, :tokenizer.vocab_size]
        mask, history = constraints.processor(constraint), TokenHistory([list(prompt)], vocab_size=tokenizer.vocab_size)
        diverged = False
        for i, token in enumerate(bound):
            row = logits[i:i + 1].clone()
            masked = mask(history, row.clone())[0]
            best_allowed = int(masked.argmax())
            # Picked among the allowed tokens exactly as without the mask (a near tie aside).
            assert token == best_allowed or masked[best_allowed] - masked[token] < 1e-4, (seed, i)
            free_choice = int(row[0].argmax())
            if torch.isfinite(masked[free_choice]):
                assert token == free_choice or row[0, free_choice] - row[0, token] < 1e-4, (seed, i)
                free_picks.append(1)
                if not diverged:
                    assert free[i] == token  # the same tokens as the free run until the mask first steps in
            else:
                diverged = True
            history.append([token])


# -- how replies end -------------------------------------------------------------------------------------


def test_a_complete_grammar_ends_with_stop_grammar_and_the_model_may_end_first(engine, tokenizer):
    prompt = prompt_ids(tokenizer)
    done = engine.generate(Request(prompt, sampling=GREEDY, max_tokens=50, constraint=Constraint.regex("[0-9]{3}")))
    assert done.finish_reason == GenerationState.STOP_GRAMMAR and re.fullmatch("[0-9]{3}", done.text)
    assert len(done.token_ids) <= 3 and not set(done.token_ids) & stop_ids_of(tokenizer)
    # "(ab)+" accepts after every "ab" but may go on: the end token is allowed there, and a model
    # that prefers it ends the reply itself.
    eos = tokenizer.eos_id
    eager = SamplingParams(temperature=0.0, logit_bias=((eos, 100.0),))
    done = engine.generate(Request(prompt, sampling=eager, max_tokens=50, constraint=Constraint.regex("(ab)+")))
    assert done.finish_reason == GenerationState.EOS and done.text == "ab"
    # A request's own end tokens (a chat format's, without text) are allowed where the grammar
    # accepts, too.
    other = tokenizer.bos_id
    assert tokenizer.token_bytes(other) == b"" and other not in stop_ids_of(tokenizer)
    eager = SamplingParams(temperature=0.0, logit_bias=((other, 100.0),))
    done = engine.generate(Request(prompt, sampling=eager, max_tokens=50, constraint=Constraint.regex("(ab)+"),
                                   stop_ids=(other,)))
    assert done.finish_reason == GenerationState.EOS and done.text == "ab"


def test_budget_before_completion_is_max_tokens(engine, tokenizer):
    done = engine.generate(Request(prompt_ids(tokenizer), sampling=GREEDY, max_tokens=3,
                                   constraint=Constraint.json_schema(SCHEMAS["flat object"])))
    assert done.finish_reason == GenerationState.MAX_TOKENS and done.text.startswith("{")


class Letters:
    """A vocabulary of three letters and an end token, without byte pieces."""

    vocab_size = 4

    def token_bytes(self, token_id: int) -> bytes:
        return (b"a", b"b", b"c", b"")[token_id]


def test_a_constraint_the_vocabulary_cannot_spell_is_a_request_error():
    constraints = Constraints(Letters(), {3})
    assert constraints.compile(Constraint.regex("(a|b)+c")) is constraints.compile(Constraint.regex("(a|b)+c"))
    with pytest.raises(RequestError, match="^regex allows no token of this model's vocabulary$"):
        check_constraint(Request((1,), constraint=Constraint.regex("x+")), constraints)


# -- the command: one-shot, --batch, the chat ---------------------------------------------------------

CLI_SCHEMA = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
                             "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}},
              "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cli_support import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("cli_constraints"))


def test_one_shot_command_takes_each_option(tiny, tmp_path):
    from cli_support import command_request, json_result, run_cli

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(CLI_SCHEMA, indent=2))
    (tmp_path / "yes_no.gbnf").write_text('root ::= answer "."\nanswer ::= "yes" | "no"\n')
    (tmp_path / "list.lark").write_text('start: item ("," item){0,2}\nitem: /[a-z]{1,6}/\n')
    cases = [
        (["--json-schema", str(schema_file)], lambda text: check_json(text, CLI_SCHEMA)),
        (["--json-schema", json.dumps(CLI_SCHEMA)], lambda text: check_json(text, CLI_SCHEMA)),
        (["--format", "json"], lambda text: json.loads(text)),
        (["--regex", PATTERNS["date"]], lambda text: check_pattern(text, PATTERNS["date"])),
        (["--grammar", str(tmp_path / "yes_no.gbnf")], lambda text: check_pattern(text, "(yes|no)\\.")),
        (["--grammar", str(tmp_path / "list.lark")], lambda text: check_pattern(text, "[a-z]{1,6}(,[a-z]{1,6}){0,2}")),
    ]
    # Each case parsed as the command parses it and run in this process, the first also through
    # the command (what it adds is the same for every option, and each process spends seconds
    # importing torch).
    loaded = load_model(tiny.path, device="cpu")
    scheduler = Scheduler.from_loaded(loaded)
    for n, (args, check) in enumerate(cases):
        # --format json allows any object: sampled strings may run on, so it runs greedy.
        sampling = ["-t", "0"] if args[0] == "--format" else ["-t", "1", "--top-p", "1", "--seed", "7"]
        line = ["-m", str(tiny.path), "-p", "Tell me", "-n", "300", "--json", *sampling, *args]
        done = scheduler.generate(command_request(loaded, *line))
        assert done.finish_reason in (GenerationState.STOP_GRAMMAR, GenerationState.EOS), (args, done)
        check(done.text.strip())
        if n == 0:
            result = json_result(run_cli(*line))
            assert (result["text"], result["finish_reason"]) == (done.text, done.finish_reason.value)


@pytest.mark.parametrize("args, message", [
    (["--json-schema", "{bad"], "Invalid value for '--json-schema': is not valid JSON"),
    (["--json-schema", '{"type": "foo"}'], "Invalid type: foo"),
    (["--regex", "a("], "Invalid value for '--regex': invalid regex \"a(\": unclosed group"),
    (["--grammar", "/no/such/file"], "Invalid value for '--grammar': cannot read '/no/such/file'"),
    (["--format", "yaml"], "Invalid value for '--format': must be one of json, none, got 'yaml'"),
    (["--format", "json", "--regex", "a+"], "structured output takes one of --json-schema, --format json, --regex "
                                            "and --grammar, got 2"),
])
def test_bad_constraints_are_one_line_and_exit_2_before_the_model_loads(args, message):
    from cli_support import run_cli

    proc = run_cli("-m", "/no/such/model", "-p", "hi", *args)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert "/no/such/model" not in err  # refused before the model was looked for


def test_batch_lines_each_with_their_own_constraint(tiny, tmp_path):
    from cli_support import run_cli

    other = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
             "required": ["ok", "level"], "additionalProperties": False}
    jobs = [
        {"prompt": "One", "json_schema": CLI_SCHEMA},
        {"prompt": "Two", "json_schema": other, "seed": 3},
        {"prompt": "Three", "regex": PATTERNS["e-mail"]},
        {"prompt": "Four", "grammar": 'start: "yes" | "no"'},
        {"prompt": "Five", "format": "none", "max_tokens": 5},  # no constraint, though the command line has one
        {"prompt": "Six", "json_schema": {"type": "nonsense"}},
        {"prompt": "Seven", "regex": "a", "format": "json"},
        {"prompt": "Eight"},  # the command line's constraint
    ]
    src = tmp_path / "jobs.jsonl"
    src.write_text("\n".join(json.dumps(job) for job in jobs) + "\n")
    proc = run_cli("-m", str(tiny.path), "--batch", str(src), "--ordered", "-t", "1", "--top-p", "1", "-n", "300",
                   "--json-schema", json.dumps(other))
    assert proc.returncode == 2, proc.stderr.decode()  # two bad lines, reported; the others ran
    out = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [o["line"] for o in out] == list(range(1, 9))
    check_json(out[0]["text"], CLI_SCHEMA)
    check_json(out[1]["text"], other)
    check_pattern(out[2]["text"], PATTERNS["e-mail"])
    assert out[3]["text"] in ("yes", "no")
    assert out[4]["finish_reason"] == "max_tokens"
    assert "Invalid type: nonsense" in out[5]["error"] and "at a time" in out[6]["error"]
    check_json(out[7]["text"], other)
    assert all(o["finish_reason"] in ("stop_grammar", "eos") for o in (out[:4] + out[7:]))


def test_chat_set_format_and_schema(tiny, tmp_path):
    import pexpect

    from cli_support import cli_env, spawn_cli

    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(CLI_SCHEMA))
    child = spawn_cli(["-m", str(tiny.path), "--template", "llama2", "-t", "0", "-n", "300"],
                      env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=120, encoding="utf-8",
                      dimensions=(40, 160))
    child.expect_exact(">>> ")
    child.sendline("/set regex [a-z]{2")
    child.expect_exact("unclosed counted repetition")
    child.expect_exact(">>> ")
    child.sendline(f"/set json_schema {schema_file}")
    child.expect_exact(">>> ")
    child.sendline("Tell me about a fox")
    child.expect_exact(">>> ")
    child.sendline("/set format json")
    child.expect_exact(">>> ")
    child.sendline("And a rabbit")
    child.expect_exact(">>> ")
    child.sendline("/set format none")
    child.expect_exact(">>> ")
    child.sendline("/set")
    child.expect_exact("json_schema=None  format=None  regex=None  grammar=None")
    child.expect_exact(">>> ")
    child.sendline(f"/save {tmp_path / 'chat.json'}")
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    replies = [m["content"] for m in json.loads((tmp_path / "chat.json").read_text())["messages"]
               if m["role"] == "assistant"]
    assert len(replies) == 2
    check_json(replies[0], CLI_SCHEMA)
    assert isinstance(json.loads(replies[1]), dict)
