"""End-to-end check of `baton serve` with the official OpenAI Python SDK.

Plain script (no pytest): runs every `test_*` function against the server at
$BATON_BASE_URL (e.g. http://127.0.0.1:8000/v1), prints one line per test and a closing
"N passed, N failed" line, and exits non-zero if anything failed.

Token counts are checked against `baton tokenize`: `--baton PATH` (default `baton` on PATH)
with `--model M` when given. Expects the default model (SmolLM2-135M-Instruct).
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import traceback

try:
    import openai
except ImportError:
    sys.exit(
        "error: the `openai` package is missing; install it with "
        "`pip install -r tests/python/requirements.txt`"
    )

BASE_URL = os.environ.get("BATON_BASE_URL")
if not BASE_URL:
    sys.exit("error: set BATON_BASE_URL to the server's /v1 URL, e.g. http://127.0.0.1:8000/v1")

# The key the server requires (`baton serve --api-key`), if it requires one.
API_KEY = os.environ.get("BATON_API_KEY")
client = openai.OpenAI(base_url=BASE_URL, api_key=API_KEY or "unused", max_retries=0, timeout=300)
MODEL = None  # filled from /v1/models

PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


ARGS = argparse.Namespace(baton="baton", model=None, prefix_cache=False)  # replaced in main()


def tokenize(text, chat=False):
    """Token ids `baton tokenize` gives for `text`."""
    cmd = [ARGS.baton, "tokenize", "--text", text]
    if ARGS.model:
        cmd += ["--model", ARGS.model]
    if chat:
        cmd.append("--chat")
    # baton reads BATON_* variables as settings; these two are test inputs, not settings.
    env = {
        k: v for k, v in os.environ.items() if k not in ("BATON_BASE_URL", "BATON_TEST_PYTHON", "BATON_API_KEY")
    }
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert out.returncode == 0, f"{cmd} failed: {out.stderr}"
    return json.loads(out.stdout)["ids"]


def user(text):
    return [{"role": "user", "content": text}]


def expect_error(kind, fn, needle=None):
    """`fn()` must raise the SDK error `kind` (with `needle` in its message)."""
    try:
        fn()
    except kind as e:
        if needle is not None:
            assert needle in str(e), f"{needle!r} not in {e}"
        return e
    raise AssertionError(f"expected {kind.__name__}")


def counts(usage):
    """A usage's token counts (a repeated prompt may differ only in cached_tokens)."""
    return (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def cached_tokens(usage):
    details = usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens


def test_models():
    global MODEL
    models = client.models.list().data
    assert len(models) == 1, models
    MODEL = models[0].id
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion():
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = r.choices[0]
    assert "Paris" in choice.text, choice.text
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenize(PROMPT)), r.usage
    assert choice.finish_reason in ("stop", "length")
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 8, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches():
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = client.completions.create(**args)
    text, finish, usage = "", None, None
    for chunk in client.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == whole.choices[0].text, (text, whole.choices[0].text)
    assert finish == whole.choices[0].finish_reason
    assert counts(usage) == counts(whole.usage), (usage, whole.usage)


def test_chat():
    r = client.chat.completions.create(model=MODEL, messages=user(QUESTION), max_tokens=24, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert "Paris" in msg.content, msg.content
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(tokenize(QUESTION, chat=True)), r.usage
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 24, r.usage


def test_chat_stream_matches():
    args = dict(model=MODEL, messages=user(QUESTION), max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content, (text, whole.choices[0].message.content)
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and counts(chunks[-1].usage) == counts(whole.usage)


def test_stop_strings():
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**args).choices[0].text
    assert len(full) >= 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = full[: full.find(stop)]
    r = client.completions.create(**args, stop=[stop, "@@@"])
    assert r.choices[0].text == want, (r.choices[0].text, want, stop)
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stop=stop, stream=True))
    assert streamed == want, (streamed, want)


def test_chat_logprobs():
    r = client.chat.completions.create(
        model=MODEL, messages=user(QUESTION), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    for t in content:
        assert isinstance(t.token, str) and t.logprob <= 0 and isinstance(t.bytes, list)
        assert len(t.top_logprobs) == 3
        probs = [a.logprob for a in t.top_logprobs]
        assert probs == sorted(probs, reverse=True), probs
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    if r.choices[0].finish_reason == "length":  # no EOS token among them
        assert "".join(t.token for t in content) == r.choices[0].message.content


def test_completion_logprobs():
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(top) >= 2 for top in lp.top_logprobs), lp.top_logprobs


def test_seeded_sampling_is_reproducible():
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234)
    a = client.completions.create(**args).choices[0].text
    b = client.completions.create(**args).choices[0].text
    assert a == b, (a, b)


def test_ignore_eos_runs_to_max_tokens():
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length", r


def test_concurrent_requests_get_their_own_output():
    # Different prompts at once, half of them streamed: each must equal its own answer alone.
    prompts = ["The capital of France is", "def fibonacci(n):", "Rust is a language that",
               "1, 2, 3, 4,", "The sky is", "Once upon a time"]
    args = dict(model=MODEL, max_tokens=10, temperature=0)
    alone = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]

    def run(i):
        if i % 2:
            return "".join(c.choices[0].text for c in client.completions.create(prompt=prompts[i], stream=True, **args)
                           if c.choices)
        return client.completions.create(prompt=prompts[i], **args).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, range(len(prompts))))
    assert together == alone, list(zip(prompts, alone, together))


def test_errors():
    expect_error(openai.NotFoundError, lambda: client.completions.create(model="no-such-model", prompt="hi"))
    expect_error(
        openai.BadRequestError, lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=0), "max_tokens"
    )
    expect_error(openai.BadRequestError, lambda: client.chat.completions.create(model=MODEL, messages=[]))
    expect_error(
        openai.BadRequestError,
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10**6),
        "maximum context length",
    )
    e = expect_error(openai.BadRequestError, lambda: client.completions.create(model=MODEL, prompt="hi", n=2))
    assert e.body["param"] == "n", e.body
    e = expect_error(
        openai.BadRequestError,
        lambda: client.chat.completions.create(model=MODEL, messages=user("hi"), temperature=-1),
    )
    assert e.body["param"] == "temperature", e.body
    expect_error(
        openai.BadRequestError,
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]),
    )


def test_prefix_cache_reports_cached_prompt_tokens():
    system = (
        "You answer questions about a small library. It opens at nine, closes at five, "
        "lends at most six books per card, and keeps audio books on the second floor."
    )
    ask = lambda q: client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
        max_tokens=6,
        temperature=0,
    )
    first = ask("When does the library open?")
    again = ask("When does the library open?")
    other = ask("How many books can I borrow?")
    assert again.choices[0].message.content == first.choices[0].message.content
    if not ARGS.prefix_cache:
        for r in (first, again, other):
            assert cached_tokens(r.usage) == 0, r.usage
        return
    n = again.usage.prompt_tokens
    # Whole 16-token blocks, never the prompt's last position.
    assert cached_tokens(again.usage) == (n - 1) // 16 * 16, again.usage
    shared = cached_tokens(other.usage)
    assert 32 <= shared < other.usage.prompt_tokens and shared % 16 == 0, other.usage


def test_api_keys():
    """A server started with a key answers a wrong one with the SDK's AuthenticationError
    (OpenAI's 401 body); an open server takes any key."""
    other = openai.OpenAI(base_url=BASE_URL, api_key="not-the-key", max_retries=0, timeout=60)
    if not API_KEY:
        assert other.models.list().data, "an open server takes any key"
        return
    try:
        other.models.list()
    except openai.AuthenticationError as e:
        assert e.status_code == 401, e
        assert e.code == "invalid_api_key", e.body
        assert "Incorrect API key" in e.message, e.message
    else:
        raise AssertionError("a wrong API key was accepted")
    assert client.models.list().data, "the right key is accepted"


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baton", default="baton", help="the baton binary (for `baton tokenize`)")
    parser.add_argument("--model", help="--model to pass to `baton tokenize` (default: the default model)")
    parser.add_argument(
        "--prefix-cache", action="store_true", help="the server caches prefixes (expect cached_tokens > 0)"
    )
    ARGS = parser.parse_args()
    tests = [(name, fn) for name, fn in globals().items() if name.startswith("test_") and callable(fn)]
    passed = failed = 0
    for name, fn in tests:
        try:
            fn()
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        else:
            passed += 1
            print(f"ok   {name}", flush=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
