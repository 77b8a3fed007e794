"""The live server through the official `openai` client (and raw HTTP where the shape matters).

References are computed in this process, from the same builtin:tiny weights: greedy text from
`engine.generate`, prompt log-probabilities from one full forward pass in float64 log_softmax.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from latentkv.engine.generate import generate
from latentkv.engine.sampling import SamplingParams
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer

MODEL = "builtin:tiny"
EOS = 1


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=60)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    """The same weights in this process, for reference outputs."""

    class Ref:
        model = load_model(tiny_dir, device="cpu")
        tokenizer = Tokenizer(tiny_dir)

        def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
            out = generate(self.model, ids, max_tokens, SamplingParams(), stop_ids=(EOS,))
            return out.tokens

        def text(self, tokens: list[int]) -> str:
            return self.tokenizer.decode([t for t in tokens if t != EOS])

        def prompt_logprobs(self, ids: list[int]) -> list[float]:
            """log p(ids[i] | ids[:i]) for i >= 1."""
            logits = self.model.forward(torch.tensor(ids), self.model.make_cache(), all_logits=True)
            logp = torch.log_softmax(logits.double(), dim=-1)
            return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]

    return Ref()


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# --- discovery and tokenizer endpoints ---------------------------------------------------------


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_tokenize_and_detokenize_round_trip(server, ref):
    text = "héllo, wörld €"
    with server.http() as http:
        out = http.post("/tokenize", json={"prompt": text}).json()
        assert out["tokens"] == ref.tokenizer.encode(text) and out["count"] == len(out["tokens"])
        assert out["max_model_len"] == 512
        back = http.post("/detokenize", json={"tokens": out["tokens"]}).json()
        assert back == {"prompt": text}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == ref.tokenizer.encode("User: hi\nAssistant:")
        error_of(http.post("/detokenize", json={"tokens": [0, 256]}), 400)
        error_of(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404)


def test_lm_eval_remote_tokenizer_reads_the_special_tokens(server):
    from lm_eval.utils import RemoteTokenizer

    tok = RemoteTokenizer(f"{server.url}/v1/completions", auth_token=server.key)
    assert tok.eos_token_id == EOS and tok.bos_token_id == 0
    assert tok.encode("abc") == [97, 98, 99] and tok.decode([97, 98, 99]) == "abc"


# --- completions ---------------------------------------------------------------------------------


def test_a_greedy_completion_is_what_the_engine_generates_alone(client, ref):
    prompt = "def main():"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    expected = ref.greedy(ref.tokenizer.encode(prompt), 12)
    assert out.choices[0].text == ref.text(expected)
    assert out.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert out.usage.prompt_tokens == len(prompt.encode())
    assert out.usage.completion_tokens == len(expected)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_every_prompt_shape_gives_one_choice_per_prompt_in_order(client, ref):
    texts = ["first prompt", "second, longer prompt"]
    expected = [ref.text(ref.greedy(ref.tokenizer.encode(t), 6)) for t in texts]
    ids = [ref.tokenizer.encode(t) for t in texts]
    for prompt in (texts, ids):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == expected
        assert out.usage.prompt_tokens == sum(len(i) for i in ids)
    single = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=6, temperature=0)
    assert single.choices[0].text == expected[1]


def test_n_choices_use_derived_seeds_and_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=1234)
    both = client.completions.create(n=2, **kwargs)
    again = client.completions.create(n=2, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.text for c in both.choices] == [c.text for c in again.choices]
    # Choice j samples with seed + j: the second choice is the first choice of seed + 1.
    shifted = client.completions.create(n=1, **{**kwargs, "seed": 1235})
    assert shifted.choices[0].text == both.choices[1].text
    assert both.usage.prompt_tokens == len(b"seeded")  # the prompt counts once, not per choice


def test_a_stop_string_ends_the_text_before_it(client, ref):
    prompt = "stop here:"
    full = ref.text(ref.greedy(ref.tokenizer.encode(prompt), 40))
    candidates = [full[i : i + 2] for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    if not candidates:
        pytest.skip("the reference text has no clean two-character stop")
    stop = candidates[0]
    expected = full[: full.index(stop)]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00\x00"]
    )
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_echo_with_logprobs_scores_every_prompt_token_like_a_full_forward_pass(client, ref):
    """What lm-evaluation-harness's local-completions sends: ids, echo, logprobs=1, max_tokens=1."""
    prompts = [ref.tokenizer.encode("the quick brown fox"), ref.tokenizer.encode("jumps over")]
    out = client.completions.create(
        model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    for ids, choice in zip(prompts, sorted(out.choices, key=lambda c: c.index), strict=True):
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the one generated token
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        expected = ref.prompt_logprobs(ids)
        got = lp.token_logprobs[1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
        for token, top, logprob in zip(
            lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True
        ):
            assert top[token] == pytest.approx(logprob) and max(top.values()) >= logprob - 1e-6
        assert lp.tokens[: len(ids)] == [ref.tokenizer.decode([t]) for t in ids]
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert choice.text.startswith(ref.tokenizer.decode(ids))
    scored = client.completions.create(model=MODEL, prompt=prompts[0], echo=True, logprobs=0, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == ref.tokenizer.decode(prompts[0]) and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(prompts[0])
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs(prompts[0]), abs=1e-4)


def test_a_sampled_stop_token_is_listed_in_echoed_logprobs_but_not_in_the_text(client, ref):
    """lm-eval reads token_logprobs[ctxlen:-1]: the one generated token needs its entry even when
    it ends generation (the scheduler does not yield a stop token)."""
    ids = ref.tokenizer.encode("the end")
    [stop] = ref.greedy(ids, 1)
    out = client.completions.create(
        model=MODEL,
        prompt=ids,
        echo=True,
        logprobs=1,
        max_tokens=1,
        temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )
    choice = out.choices[0]
    assert len(choice.logprobs.token_logprobs) == len(ids) + 1 and choice.finish_reason == "stop"
    assert choice.text == ref.tokenizer.decode(ids) and out.usage.completion_tokens == 1
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert plain.choices[0].text == "" and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == 1  # the stop token was sampled: it counts


def test_streaming_completion_adds_up_to_the_whole_answer_then_usage(client):
    kwargs = dict(model=MODEL, prompt="stream me", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_sse_wire_format_ends_with_done(server):
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][6:])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1


# --- chat ------------------------------------------------------------------------------------------


def test_chat_renders_the_plain_transcript_and_answers_like_the_completion(client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    prompt = ref.tokenizer.encode("be brief\n\nUser: hi\nAssistant:")
    expected = ref.greedy(prompt, 10)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text(expected)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(expected)


def test_chat_streams_role_first_then_content_then_usage(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs_list_each_token_with_its_top_alternatives(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-6)  # greedy takes the most likely token
        assert entry.bytes == list(entry.token.encode())


def test_a_chat_session_resumes_the_previous_turn(server):
    def turn(messages):
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "session": "chat-1"}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers)
        assert response.status_code == 200, response.text
        return response.json()

    first_messages = [{"role": "user", "content": "remember this"}]
    first = turn(first_messages)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = first["choices"][0]["message"]["content"]
    second = turn(
        [*first_messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}]
    )
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    )  # at least the whole first prompt


# --- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [5, 300]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "presence_penalty": 0.5}, None),
        ({"prompt": "x", "session": "../etc"}, "session"),
        ({"prompt": ["a", "b"], "session": "s"}, "session"),
        ({"prompt": "x", "stop": ""}, None),
    ],
)
def test_invalid_completion_parameters_are_400_never_422(server, body, param):
    with server.http() as http:
        error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_a_prompt_of_no_accepted_shape_says_which_shapes_are(server):
    with server.http() as http:
        error = error_of(http.post("/v1/completions", json={"prompt": ["a", 1]}), 400)
    assert error["message"].startswith("prompt: must be a string, a list of strings, a list of token ids")


def test_a_body_that_is_not_json_is_400(server):
    with server.http() as http:
        response = http.post(
            "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert "JSON" in error_of(response, 400)["message"]


def test_unknown_fields_are_ignored(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate": True})
    assert response.status_code == 200


def test_prompt_plus_max_tokens_over_the_context_is_400(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * 500, max_tokens=13)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert "512" in info.value.message
    with server.http() as http:
        error = error_of(
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 600}]}),
            400,
        )
    assert error["code"] == "context_length_exceeded"


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_a_missing_or_wrong_key_is_401(server):
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    error = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}), 401)
    assert error["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key


def test_chat_parameter_errors(server):
    with server.http() as http:
        no_messages = error_of(http.post("/v1/chat/completions", json={"messages": []}), 400)
        assert no_messages["param"] == "messages"
        bad_role = error_of(
            http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400
        )
        assert bad_role["param"].startswith("messages")
        assistant_first = [{"role": "assistant", "content": "x"}]
        error_of(http.post("/v1/chat/completions", json={"messages": assistant_first}), 400)
        top_without = {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
        error_of(http.post("/v1/chat/completions", json=top_without), 400)


# --- metrics and cancellation ----------------------------------------------------------------------


def _metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _metric(metrics: dict[str, float], name: str) -> float:
    [value] = [v for k, v in metrics.items() if k.split("{")[0] == name]
    return value


def test_metrics_count_tokens_and_report_kv_bytes(server, client):
    before = _metrics(server)
    out = client.completions.create(
        model=MODEL, prompt="count me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = _metrics(server)
    assert out.usage.completion_tokens == 5
    gen = _metric(after, "latentkv_generation_tokens_total") - _metric(
        before, "latentkv_generation_tokens_total"
    )
    prompt = _metric(after, "latentkv_prompt_tokens_total") - _metric(before, "latentkv_prompt_tokens_total")
    assert gen == 5 and prompt == len(b"count me")
    capacity = [k for k in after if k.startswith("latentkv_kv_cache_capacity_bytes")]
    assert capacity and 'tier="f32"' in capacity[0] and after[capacity[0]] > 0
    assert _metric(after, "latentkv_model_loaded") == 1
    ok = [
        k
        for k in after
        if k.startswith("latentkv_http_requests_total")
        and 'route="/v1/completions"' in k
        and 'status="200"' in k
    ]
    assert ok and after[ok[0]] >= 1


def test_the_request_histograms_move(server):
    from tests.server.test_metrics import _samples, _value

    def scrape() -> dict:
        return _samples(httpx.get(f"{server.url}/metrics").text)

    before = scrape()
    prompt = "histogram me"
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
    with server.http() as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        stream = {**body, "stream": True, "n": 1}
        with http.stream("POST", "/v1/completions", json=stream) as response:
            assert response.status_code == 200 and sum(1 for _ in response.iter_lines()) > 6
    after = scrape()

    def grew(name: str) -> float:
        return _value(after, name) - _value(before, name)

    sequences = 3
    for name in (
        "latentkv_time_to_first_token_seconds",
        "latentkv_e2e_request_latency_seconds",
        "latentkv_request_queue_time_seconds",
        "latentkv_request_prefill_time_seconds",
        "latentkv_request_decode_time_seconds",
    ):
        assert grew(f"{name}_count") == sequences, name
    assert grew("latentkv_time_to_first_token_seconds_sum") > 0
    assert grew("latentkv_e2e_request_latency_seconds_sum") > grew("latentkv_time_to_first_token_seconds_sum")
    assert grew("latentkv_inter_token_latency_seconds_count") == sequences * 5
    assert grew("latentkv_request_prompt_tokens_sum") == sequences * len(prompt.encode())
    assert grew("latentkv_request_generation_tokens_sum") == sequences * 6
    key = ("latentkv_request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert after[key] - before.get(key, 0) == sequences


def test_a_disconnected_stream_is_cancelled(server):
    before = _metric(_metrics(server), "latentkv_generation_tokens_total")
    body = {"prompt": "go", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first chunk
    deadline = time.monotonic() + 10
    while _metric(_metrics(server), "latentkv_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _metrics(server)
    assert _metric(after, "latentkv_requests_running") == 0
    assert _metric(after, "latentkv_generation_tokens_total") - before < 500


def test_a_disconnected_json_request_is_cancelled(server):
    """The server notices a JSON request's client has gone within its poll (0.25 s) and cancels the
    choices. 16 choices of 500 tokens, 4 at a time, take ~4 s here (~1 s a round of 4, measured
    beside other work); with one choice (~0.55-0.75 s) the request could finish about when the poll
    noticed the client that left at 0.5 s, and the test failed now and then."""
    before = _metric(_metrics(server), "latentkv_generation_tokens_total")
    body = {"prompt": "go", "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.ReadTimeout), server.http() as http:
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.2))
    deadline = time.monotonic() + 10
    while _metric(_metrics(server), "latentkv_requests_running") and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _metrics(server)
    assert _metric(after, "latentkv_requests_running") == 0
    assert _metric(after, "latentkv_generation_tokens_total") - before < 16 * 500 / 2


def test_a_failure_after_the_stream_started_is_an_error_event_then_done(server, ref, tiny_dir):
    """A session file held by another process fails the request inside the worker, after the
    stream's first chunk went out: an in-band 409-shaped error (a JSON request gets the 409)."""
    from types import SimpleNamespace

    from latentkv.commands.session import Conversation

    held = Conversation.open(
        "held", server.kv_dir, SimpleNamespace(model=ref.model, directory=tiny_dir, tier=ref.model.tier())
    )
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "session": "held", "stream": True}
        with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [e for e in response.read().decode().split("\n\n") if e]
        assert json.loads(events[0][6:])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        error = json.loads(events[-2][6:])["error"]
        assert "in use by another process" in error["message"] and error["type"] == "conflict_error"
        assert error["code"] == "session_busy"
        assert events[-1] == "data: [DONE]"
        with pytest.raises(openai.APIError, match="in use by another process"):
            list(
                server.client().chat.completions.create(
                    model=MODEL,
                    stream=True,
                    **{k: body[k] for k in ("messages",)},
                    extra_body={"session": "held"},
                )
            )
        with server.http() as http:
            failed = error_of(http.post("/v1/completions", json={"prompt": "x", "session": "held"}), 409)
        assert failed["code"] == "session_busy"
    finally:
        held.close()
