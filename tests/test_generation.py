"""Text made by one job at a time: responses, stop strings, the leading space, and pages kept across requests."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from builders import random_model, tiny_args, train_sentencepiece
from llama_chat.inference.decoding import TextMaker
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import GenerationState, Request
from llama_chat.ml.grammars import Constraint
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model.tokenizers.sentencepiece import SentencePieceTokenizer

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return SentencePieceTokenizer(train_sentencepiece(tmp_path_factory.mktemp("gen_spm"), vocab_size=512))


@pytest.fixture(scope="module")
def model(tokenizer):
    return random_model(tiny_args(tokenizer.vocab_size, max_seq_len=256), seed=1)


def single(model, tokenizer) -> Scheduler:
    """A scheduler of one job at a time, as a prompt or a chat runs."""
    return Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, page_size=8, prefill_chunk=8))


@pytest.fixture()
def engine(model, tokenizer):
    return single(model, tokenizer)


def ids(tokenizer, text="Once upon a time"):
    return tuple(tokenizer.encode(text, bos=True))


# -- TextMaker --------------------------------------------------------------------------------------

chunks = st.lists(st.binary(max_size=6) | st.sampled_from([b"ab", b"c", b" a", "é".encode(), b"\xf0\x9f"]),
                  max_size=30)
stops = st.lists(st.text(alphabet="abc é", min_size=1, max_size=4), max_size=3)


def cut_when_a_stop_string_is_complete(text: str, stop_strings: list[str]) -> str | None:
    """OpenAI's rule, read character by character: at the first character that completes any
    stop string, the text ends before that string (the longest, if several end there)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stop_strings if text.endswith(s, 0, end)]
        if done:
            return text[:end - max(map(len, done))]
    return None


@given(chunks, stops, st.booleans())
def test_text_is_the_decoded_text_cut_before_the_first_stop_string_to_be_complete(data, stop_strings, strip):
    maker = TextMaker(stop_strings, strip_leading_space=strip)
    out = "".join(maker.feed(d) for d in data) + maker.finish()
    joined = b"".join(data)
    if strip:
        first = next((i for i, d in enumerate(data) if d), None)
        if first is not None and data[first].startswith(b" "):
            joined = b"".join(data[:first]) + data[first][1:] + b"".join(data[first + 1:])
    full = joined.decode("utf-8", errors="replace")
    cut = cut_when_a_stop_string_is_complete(full, stop_strings)
    assert out == (full if cut is None else cut)
    assert maker.stopped == (cut is not None)


@pytest.mark.parametrize(("tokens", "stop_strings", "text"), [
    ([b"a", b"c", b" "], ["c", "ac "], "a"),  # "c" is complete before "ac " is
    ([b"ac "], ["c", "ac "], "a"),  # the same in one token
    ([b"xab"], ["b", "ab"], "x"),  # complete at the same character: the longer one cuts
    ([b"abc"], ["abc", "zz"], ""),
])
def test_the_first_stop_string_to_be_complete_ends_the_text(tokens, stop_strings, text):
    maker = TextMaker(stop_strings)
    assert "".join(map(maker.feed, tokens)) + maker.finish() == text and maker.stopped


def test_text_is_held_only_while_it_could_start_a_stop_string():
    maker = TextMaker(["END"])
    assert maker.feed(b"the E") == "the "
    assert maker.held_text == "E" and maker.held_tokens == 1
    assert maker.feed(b"xit") == "Exit"  # no longer a possible start: released
    assert maker.held_text == "" and maker.held_tokens == 0
    assert maker.feed(b" E") == " "
    assert maker.feed(b"N") == ""
    assert maker.held_tokens == 2
    assert maker.feed(b"D and more") == "" and maker.stopped
    assert maker.finish() == ""


# -- the responses ------------------------------------------------------------------------------------


async def responses(engine, request):
    async with engine.stream(request) as generation:
        return [r async for r in generation], generation.completion()


def test_responses_carry_the_text_and_the_last_one_the_reason(engine, tokenizer):
    request = Request(ids(tokenizer), sampling=GREEDY, max_tokens=30)
    got, done = anyio.run(responses, engine, request)
    assert [r.index for r in got] == list(range(30))
    assert got[-1].state is GenerationState.MAX_TOKENS and got[-1].held_bytes == b"" and got[-1].held_text == ""
    assert "".join(r.text for r in got) == done.text
    data = b"".join(tokenizer.token_bytes(r.token_id) for r in got)
    assert done.text == data.decode("utf-8", errors="replace")


def test_a_chat_reply_drops_the_word_start_space(model, tokenizer):
    words = tokenizer.encode("the cat sat", bos=False)
    assert tokenizer.token_bytes(words[0]).startswith(b" ")
    spelled = Constraint("regex", " the cat sat")  # the same words, whatever the logits say
    scheduler = single(model, tokenizer)
    plain = scheduler.generate(Request(ids(tokenizer), sampling=GREEDY, max_tokens=20, constraint=spelled))
    reply = scheduler.generate(Request(ids(tokenizer), sampling=GREEDY, max_tokens=20, constraint=spelled,
                                       chat_reply=True))
    assert plain.text == " the cat sat" and reply.text == "the cat sat"


def test_greedy_with_a_stop_string_split_across_tokens_is_the_answer_cut_before_it(engine, tokenizer):
    full = engine.generate(Request(ids(tokenizer), sampling=GREEDY, max_tokens=60))
    pieces = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next.
    k = next(i for i in range(5, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    cut = full.text[:full.text.find(stop)]
    stopped = engine.generate(Request(ids(tokenizer), sampling=GREEDY, max_tokens=60, stop=(stop,)))
    assert stopped.finish_reason is GenerationState.STOP_STRING
    assert stopped.text == cut and stop not in stopped.text
    assert len(stopped.token_ids) <= k + 2


# -- the cache kept between requests ------------------------------------------------------------------


def test_a_request_prefills_only_what_follows_the_common_prefix_and_matches_a_fresh_scheduler(
        model, tokenizer, engine):
    first = Request(ids(tokenizer), sampling=GREEDY, max_tokens=20, reuse_cache=True)
    done = engine.generate(first)
    assert done.cached_tokens == 0
    assert engine.cached_ids == first.prompt_ids + done.token_ids[:-1]  # the last one was never fed
    follow = first.prompt_ids + done.token_ids + tuple(tokenizer.encode(" and then", bos=False))
    second = engine.generate(Request(follow, sampling=GREEDY, max_tokens=20, reuse_cache=True))
    # Full pages of what was fed are found again.
    assert second.cached_tokens == (len(first.prompt_ids) + len(done.token_ids) - 1) // 8 * 8
    assert second.prefilled_tokens == len(follow) - second.cached_tokens

    alone = single(model, tokenizer).generate(Request(follow, sampling=GREEDY, max_tokens=20))
    assert alone.token_ids == second.token_ids and alone.cached_tokens == 0


def test_a_cancel_leaves_pages_that_hold_what_they_say(model, tokenizer, engine):
    request = Request(ids(tokenizer), sampling=GREEDY, max_tokens=100, reuse_cache=True)

    async def take(n):
        async with engine.stream(request) as generation:
            got = []
            async for response in generation:
                got.append(response.token_id)
                if len(got) == n:
                    break  # leaving early closes the stream: steps computed ahead are dropped
        return got

    got = anyio.run(take, 5)
    # The pages hold the prompt and the tokens fed; those agree with what the consumer took.
    taken = request.prompt_ids + tuple(got)
    held = engine.cached_ids
    assert held[:len(request.prompt_ids)] == request.prompt_ids
    assert held[:len(taken)] == taken[:len(held)]
    # What the pages say they hold is what they hold: the next turn matches a fresh scheduler.
    follow = taken + tuple(tokenizer.encode(" and", bos=False))
    second = engine.generate(Request(follow, sampling=GREEDY, max_tokens=10, reuse_cache=True))
    assert second.cached_tokens >= (len(request.prompt_ids) + 4) // 8 * 8
    assert single(model, tokenizer).generate(Request(follow, sampling=GREEDY, max_tokens=10)).token_ids == \
        second.token_ids
