"""The official OpenAI Python SDK (openai from PyPI) drives `lorasync serve` and `lorasync proxy`.

A tiny random Qwen2 with the real Qwen2 tokenizer, served by one replica directly and by two
replicas behind the proxy (inbound API key, upstream token). Through each endpoint: completions
(text and token-id prompts), streaming, n > 1, seeds (same seed, same text), stop strings, chat
completions (also streamed) with logprobs in the chat shape (choices[].logprobs.content[] with
token, logprob, bytes, top_logprobs), and the SDK's typed errors: NotFoundError (404, unknown
model), BadRequestError (400, invalid field), AuthenticationError (401, wrong key).
"""
import math

import openai
import pytest

from conftest import figure, lorasync, proxy, serve

KEY, TOKEN = "sk-conformance-key", "upstream-token-123"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    model = tmp / "tiny"
    lorasync("init-model", "--preset", "tiny", "--seed", 4, "--init-std", 0.1, "--output", model)
    direct = serve(model, "--served-model-name", "tiny", "--api-key", KEY)
    r0 = serve(model, "--served-model-name", "tiny", "--api-key", TOKEN)
    r1 = serve(model, "--served-model-name", "tiny", "--api-key", TOKEN)
    px = proxy([r0.url, r1.url], "--upstream-token-env", "UP_TOKEN", "--api-key-env", "IN_KEY",
               env={"UP_TOKEN": TOKEN, "IN_KEY": KEY})
    yield {"direct": direct.url, "proxy": px.url}
    for s in (px, r0, r1, direct):
        s.stop()


@pytest.fixture(params=["direct", "proxy"])
def client(request, fleet):
    return openai.OpenAI(base_url=fleet[request.param] + "/v1", api_key=KEY, max_retries=0,
                         timeout=60)


def test_completions_text_ids_n_and_seeds(client):
    r = client.completions.create(model="tiny", prompt="The answer is", max_tokens=6,
                                  temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    r2 = client.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == 4
    many = client.completions.create(model="tiny", prompt="Count:", max_tokens=5, n=4,
                                     temperature=1.0, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt="Count:", max_tokens=5, n=4,
                                      temperature=1.0, seed=7)
    assert [c.text for c in many.choices] == [c.text for c in again.choices]
    lp = client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0,
                                   logprobs=2)
    assert len(lp.choices[0].logprobs.token_logprobs) == 3
    assert all(v <= 0 for v in lp.choices[0].logprobs.token_logprobs)


def test_streaming_equals_the_whole_answer(client):
    whole = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8,
                                      temperature=0)
    parts, finish = [], None
    for chunk in client.completions.create(model="tiny", prompt="Once upon", max_tokens=8,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            parts.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(parts) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason


def test_stop_strings(client):
    free = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    text = free.choices[0].text
    if len(text) < 3:
        pytest.skip("greedy text too short to cut")
    stop = text[2:4] if text[2:4].strip() else text[1:3]
    cut = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)


def test_chat_with_logprobs_in_the_chat_shape(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    assert r.object == "chat.completion"
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    content = ch.logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert isinstance(t.token, str) and t.logprob <= 0 and math.isfinite(t.logprob)
        assert isinstance(t.bytes, list) and all(0 <= b < 256 for b in t.bytes)
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-6
    # Bytes of the tokens concatenate to the message (greedy, no stop string cut).
    joined = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    assert joined == ch.message.content
    streamed, lps = [], []
    for chunk in client.chat.completions.create(model="tiny", stream=True, max_tokens=5,
                                                temperature=0, logprobs=True,
                                                messages=[{"role": "user", "content": "hi"}]):
        for c in chunk.choices:
            streamed.append(c.delta.content or "")
            if c.logprobs and c.logprobs.content:
                lps += [t.logprob for t in c.logprobs.content]
    assert "".join(streamed) == ch.message.content
    assert lps == pytest.approx([t.logprob for t in content], abs=1e-6)
    figure("openai_chat_logprob_tokens", len(content))


def test_typed_errors(client, fleet):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="x", max_tokens=2)
    models = client.models.list()
    assert "tiny" in [m.id for m in models.data]
