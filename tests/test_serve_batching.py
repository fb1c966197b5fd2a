"""`colibri serve` under continuous batching (its default engine), driven by the official `openai`
client from several threads at once: each client gets what it gets alone (the oracle:
``stream_generate``, one request, its own prefill and decode), seeded sampling does not depend on
the company, and a multi-turn chat's second turn starts from the prompt cache
(``usage.prompt_tokens_details.cached_tokens``) with the text of a cold run."""

from __future__ import annotations

import io
import threading

import pytest

openai = pytest.importorskip("openai")

import colibri_mlx  # noqa: E402
from colibri_mlx.batch_engine import BatchEngine  # noqa: E402
from colibri_mlx.serve import ModelServer  # noqa: E402
from test_serve_openai import client, start, stop  # noqa: E402

PROMPTS = ["And the LORD spake unto Moses, saying", "In the beginning God created", "Blessed are the meek",
           "The LORD is my shepherd", "And it came to pass", "Let there be light"]


@pytest.fixture(scope="module")
def demo():
    return colibri_mlx.load(None)


@pytest.fixture(scope="module")
def server(demo):
    srv = ModelServer(("127.0.0.1", 0), *demo, "colibri-demo", log=io.StringIO())
    assert isinstance(srv.engine, BatchEngine)
    thread = start(srv)
    yield srv
    stop(srv, thread)


def alone(demo, prompt, n, **sampling) -> str:
    return "".join(r.text for r in colibri_mlx.stream_generate(*demo, prompt, max_tokens=n, draft="none",
                                                               **sampling))


def at_once(calls):
    """Run the callables on threads released together; their results in order."""
    results, errors = [None] * len(calls), []
    start = threading.Barrier(len(calls))

    def run(i):
        try:
            start.wait()
            results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 (re-raised below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def batched_rows(engine, before: dict) -> bool:
    """Whether some decode step since ``before`` (a copy of engine.stats) ran several requests."""
    return engine.stats["decode_rows"] - before["decode_rows"] > engine.stats["steps"] - before["steps"]


def test_concurrent_clients_get_their_greedy_text_alone(server, demo):
    n = 8
    c = client(server)
    before = dict(server.engine.stats)

    def completion(prompt, stream):
        if stream:
            return "".join(ch.choices[0].text for ch in c.completions.create(model="x", prompt=prompt, max_tokens=n,
                                                                               stream=True))
        return c.completions.create(model="x", prompt=prompt, max_tokens=n).choices[0].text

    got = at_once([lambda p=p, s=i % 2: completion(p, s) for i, p in enumerate(PROMPTS)])
    assert batched_rows(server.engine, before)
    assert got == [alone(demo, p, n) for p in PROMPTS]


def test_penalties_and_logprobs_in_company_equal_alone(server):
    c = client(server)
    kw = dict(model="x", prompt=PROMPTS[3], max_tokens=8, presence_penalty=1.5, frequency_penalty=0.75,
              logit_bias={"5": -100}, logprobs=2)
    solo = c.completions.create(**kw).choices[0]
    before = dict(server.engine.stats)
    results = at_once([lambda: c.completions.create(**kw).choices[0]]
                      + [lambda p=p: c.completions.create(model="x", prompt=p, max_tokens=8) for p in PROMPTS[:4]])
    assert batched_rows(server.engine, before)
    mine = results[0]
    assert mine.text == solo.text and mine.logprobs.tokens == solo.logprobs.tokens
    # the same logits up to float32 rounding (a batched decode row, a cache hit's prefill row)
    assert max(abs(a - b) for a, b in zip(mine.logprobs.token_logprobs, solo.logprobs.token_logprobs)) < 1e-3


def test_seeded_sampling_does_not_depend_on_the_company(server, demo):
    c = client(server)
    sampling = dict(temperature=1.2, top_p=0.95, seed=11)
    want = alone(demo, PROMPTS[0], 8, **sampling)
    before = dict(server.engine.stats)
    company = [lambda p=p, i=i: c.completions.create(model="x", prompt=p, max_tokens=8, temperature=0.9, seed=i)
               for i, p in enumerate(PROMPTS[1:5])]
    results = at_once([lambda: c.completions.create(model="x", prompt=PROMPTS[0], max_tokens=8, **sampling)]
                      + company)
    assert batched_rows(server.engine, before)
    assert results[0].choices[0].text == want
    assert c.completions.create(model="x", prompt=PROMPTS[0], max_tokens=8, **sampling).choices[0].text == want


def test_second_turn_starts_from_the_prompt_cache(server, demo):
    _, tok = demo
    c = client(server)
    turn1 = [{"role": "system", "content": "Answer in the words of the King James Bible."},
             {"role": "user", "content": "Who made the heaven and the earth?"}]
    first = c.chat.completions.create(model="x", messages=turn1, max_tokens=12)
    reply = first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And what of the sea?"}]
    second = c.chat.completions.create(model="x", messages=turn2, max_tokens=12)
    n_history = len(tok.encode_chat(turn1))
    # the first turn's prompt at least (its reply's tokens too where the template re-encodes them alike)
    assert second.usage.prompt_tokens_details.cached_tokens >= n_history
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.choices[0].message.content == alone(demo, tok.encode_chat(turn2), 12)


def test_requests_naming_a_draft_speculate_in_the_batch(server, demo):
    """Requests with their own ``draft`` run in the batch beside plain ones; greedy, each gets
    its text alone, and the drafts were verified (the engine counts its verify steps)."""
    c = client(server)
    engine = server.engine
    before = dict(engine.stats)
    drafts = ["mtp", "ngram", None, "mtp"]
    calls = [lambda p=p, d=d: c.completions.create(model="x", prompt=p, max_tokens=10,
                                                   extra_body={} if d is None else {"draft": d, "num_draft": 2})
             for p, d in zip(PROMPTS, drafts)]
    got = [r.choices[0].text for r in at_once(calls)]
    assert got == [alone(demo, p, 10) for p in PROMPTS[:4]]
    assert engine.stats["verify_steps"] > before["verify_steps"]
    assert engine.stats["draft_accepted"] > before["draft_accepted"]
    assert "% accepted" in server.log.getvalue()            # a speculating request's stats line
    with pytest.raises(openai.BadRequestError, match="'draft' must be one of"):
        c.completions.create(model="x", prompt=PROMPTS[0], max_tokens=2, extra_body={"draft": "medusa"})
