"""The chat page at GET / and llama-server's /tokenize, /detokenize and /apply-template: the
endpoints over real HTTP, and the page end to end in a headless Chromium driven by Playwright
(the system's Chromium: `apt-get install chromium`; the tests skip, saying so, without it or
Playwright). The embedded SmolLM2 serves on a free port of 127.0.0.1.

The browser tests wait for conditions, never for set times: an answer streams at the machine's
speed, and the waits are long enough for a slow CPU."""
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request

import pytest

from mlx_flashnorm.serve.serial import SerialWorker
from mlx_flashnorm.server import Server

from conftest import CountingWorker, serving

KEY = "page-test-key"
WAIT = 120_000  # ms: the longest a browser test waits for one condition
DRAGON = "Write a long story about a dragon who learns to read."  # greedy SmolLM2 goes on and on
FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(smollm2):
    with serving(Server(*smollm2, "smol", port=0, worker=CountingWorker(*smollm2))) as server:
        yield server


@pytest.fixture(scope="module")
def keyed(smollm2):
    """A server started with --api-key KEY."""
    with serving(Server(*smollm2, "smol", port=0, api_key=KEY,
                        worker=SerialWorker(*smollm2))) as server:
        yield server


def url(server, path="/"):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def call(server, method, path, body=None, key=None, content_type="application/json", **headers):
    """(status, headers, body: parsed JSON or bytes) of one request."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, **headers}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url(server, path), data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            status, head, raw = r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, e.headers, e.read()
    is_json = head.get("Content-Type", "").startswith("application/json")
    return status, head, json.loads(raw) if is_json else raw


# --- the endpoints --------------------------------------------------------------------------


def test_tokenize_and_detokenize_round_trip(server, smollm2):
    _, tokenizer = smollm2
    text = "Hello world: á and 😀."
    status, _, body = call(server, "POST", "/tokenize", {"content": text})
    assert status == 200 and body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert call(server, "POST", "/detokenize", {"tokens": body["tokens"]})[2] == {"content": text}
    assert call(server, "POST", "/tokenize", {"content": ""})[2] == {"tokens": []}
    assert call(server, "POST", "/detokenize", {"tokens": []})[2] == {"content": ""}
    special = call(server, "POST", "/tokenize", {"content": text, "add_special": True})[2]
    assert special["tokens"] == tokenizer.encode(text, add_special_tokens=True)


def test_tokenize_with_pieces(server):
    """Each piece is the token's text with its leading space, or its bytes where they are not
    whole characters (the emoji's four bytes split over two tokens)."""
    text = "Hello world 😀"
    ids = call(server, "POST", "/tokenize", {"content": text})[2]["tokens"]
    status, _, body = call(server, "POST", "/tokenize", {"content": text, "with_pieces": True})
    assert status == 200 and [t["id"] for t in body["tokens"]] == ids
    pieces = [t["piece"] for t in body["tokens"]]
    assert pieces[:2] == ["Hello", " world"]
    assert any(isinstance(p, list) for p in pieces)
    joined = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in pieces)
    assert joined.decode() == text


def test_apply_template_renders_what_a_chat_request_reads(server, smollm2):
    _, tokenizer = smollm2
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": FRANCE}]
    status, _, body = call(server, "POST", "/apply-template", {"messages": messages})
    assert status == 200
    assert body["prompt"] == tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                           tokenize=False)
    assert body["prompt"].endswith("<|im_start|>assistant\n")  # the generation prompt added
    chat = call(server, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 1})[2]
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.encode(body["prompt"],
                                                                  add_special_tokens=False))


@pytest.mark.parametrize("path, body, param, words", [
    ("/tokenize", {}, "content", "'content' must be a string"),
    ("/tokenize", {"content": 5}, "content", "'content' must be a string"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special", "true or false"),
    ("/tokenize", {"content": "x", "with_pieces": 1}, "with_pieces", "true or false"),
    ("/tokenize", {"content": "x", "parse_special": True}, "parse_special", "not a field"),
    ("/detokenize", {}, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": "12"}, "tokens", "a list of token ids"),
    ("/detokenize", {"tokens": [1, 2.5]}, "tokens", "'tokens'[1] is 2.5"),
    ("/detokenize", {"tokens": [True]}, "tokens", "'tokens'[0] is True"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "from 0 to 49151"),
    ("/detokenize", {"tokens": [49152]}, "tokens", "'tokens'[0] is 49152"),
    ("/detokenize", {"tokens": [1], "content": "x"}, "content", "not a field"),
    ("/apply-template", {}, "messages", "'messages' must be a non-empty list"),
    ("/apply-template", {"messages": []}, "messages", "'messages' must be a non-empty list"),
    ("/apply-template", {"messages": [{"content": "hi"}]}, "messages", "a 'role' string"),
    ("/apply-template", {"messages": [{"role": "user", "content": 3}]}, "messages", "'content'"),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
     "max_tokens", "not a field"),
])
def test_bad_fields_get_a_400_naming_them(server, path, body, param, words):
    status, _, answer = call(server, "POST", path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert words in answer["error"]["message"], answer


def test_bad_bodies_and_methods(server):
    for path in ("/tokenize", "/detokenize", "/apply-template"):
        status, _, body = call(server, "POST", path, b"{not json")
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        assert call(server, "POST", path, b"[]")[0] == 400
        assert call(server, "POST", path, b'{"content": "x"}', content_type="text/plain")[0] == 415
        assert call(server, "GET", path)[0] == 404
    assert call(server, "GET", "/nothing.js")[0] == 404


def test_the_page_is_served_without_the_key_and_the_endpoints_need_it(keyed):
    for path, kind in (("/", "text/html"), ("/index.html", "text/html"),
                       ("/app.js", "text/javascript"), ("/style.css", "text/css")):
        status, headers, body = call(keyed, "GET", path)
        assert status == 200 and headers["Content-Type"].startswith(kind) and body, path
        assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert b'<script src="app.js"' in call(keyed, "GET", "/?conversation=1")[2]
    for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [1]}),
                       ("/apply-template", {"messages": [{"role": "user", "content": "x"}]})):
        status, headers, answer = call(keyed, "POST", path, body)
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer", answer
        assert call(keyed, "POST", path, body, key="wrong")[0] == 401
        assert call(keyed, "POST", path, body, key=KEY)[0] == 200


def test_the_page_s_own_origin_is_allowed_others_are_not(server):
    """The page's calls carry the server's own origin; a site whose DNS name points at this
    machine (DNS rebinding) sends its own name as the Host and is refused: by the Host check
    (421, before the origin is looked at), and another origin on the server's own address by
    the origin check (403)."""
    port = server.server_address[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        status, headers, _ = call(server, "POST", "/tokenize", {"content": "x"}, Host=host,
                                  Origin=f"http://{host}")
        assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, _, body = call(server, "POST", "/tokenize", {"content": "x"},
                           Host=f"evil.example:{port}", Origin=f"http://evil.example:{port}")
    assert status == 421 and "evil.example" in body["error"]["message"]
    for host, origin in ((f"127.0.0.1:{port}", "http://127.0.0.1:3000"),
                         (f"127.0.0.1:{port}", f"https://127.0.0.1:{port}")):
        status, _, body = call(server, "POST", "/tokenize", {"content": "x"}, Host=host,
                               Origin=origin)
        assert status == 403 and origin in body["error"]["message"]


# --- the page in a browser ------------------------------------------------------------------


def chromium_path():
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    playwright = pytest.importorskip(
        "playwright.sync_api", reason="Playwright is not installed (pip install playwright; "
                                      "the test extra has it)")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium to drive (apt-get install chromium; or set CHROMIUM to its path)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1000, "height": 700})
    page = context.new_page()
    page.set_default_timeout(WAIT)
    errors = []
    page.on("pageerror", lambda e: errors.append(e))
    yield page
    context.close()
    assert not errors, errors  # no uncaught script error


def expect(locator):
    """Playwright's expect, waiting up to WAIT for its condition."""
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT)
    return expect(locator)


def wait_until(condition, seconds=WAIT / 1000):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def chat_requests(page):
    """The bodies of the page's chat requests, as they are sent."""
    bodies = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions")
            and bodies.append(r.post_data_json))
    return bodies


def send(page, text):
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_page_streams_stops_and_keeps_the_conversation(server, page):
    worker = server.worker
    bodies = chat_requests(page)
    page.goto(url(server))
    expect(page.locator("#model-name")).to_have_text("smol")
    page.fill("#system-prompt", "You tell stories.")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "1500")
    made = len(worker.made)
    send(page, DRAGON)

    # the answer appears piece by piece; Stop while it streams
    reply = page.locator(".message.assistant .content").last
    expect(page.locator("#stop")).to_be_visible()
    expect(reply).to_have_text(re.compile(r"\S"))
    seen = reply.inner_text()
    expect(reply).not_to_have_text(seen)
    expect(reply).to_have_text(re.compile(r"^[\s\S]{40}"))
    page.click("#stop")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator(".message.assistant .meta").last).to_contain_text("stopped")
    stopped = reply.inner_text()
    # the server dropped the request: none taken, far fewer tokens made than asked for
    wait_until(lambda: server.active == 0 and len(worker.made) == made + 1)
    assert worker.made[-1] < 1500
    assert bodies[0] == {"messages": [{"role": "system", "content": "You tell stories."},
                                      {"role": "user", "content": DRAGON}],
                         "stream": True, "stream_options": {"include_usage": True},
                         "temperature": 0, "max_tokens": 1500}

    # a second turn sends the whole conversation, the stopped answer included
    page.fill("#max-tokens", "8")
    send(page, "Give it a title.")
    expect(page.locator(".message.assistant")).to_have_count(2)
    expect(page.locator("#send")).to_be_visible()
    meta = page.locator(".message.assistant .meta").last
    expect(meta).to_have_text(re.compile(r"\b[1-8] tokens"))
    second = page.locator(".message.assistant .content").last.inner_text()
    assert second.strip()
    # the worker takes one request at a time: the first had ended, short of max_tokens
    assert worker.made[made] < 1500
    assert [m["content"] for m in bodies[1]["messages"]] == [
        "You tell stories.", DRAGON, stopped, "Give it a title."]
    assert bodies[1]["max_tokens"] == 8

    # reloaded, the page shows the conversation and the settings as they were
    page.reload()
    expect(page.locator(".message")).to_have_count(4)
    texts = page.locator(".message .content").all_inner_texts()
    assert texts == [DRAGON, stopped, "Give it a title.", second]
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations li.current")).to_contain_text(DRAGON[:40])
    expect(page.locator("#system-prompt")).to_have_value("You tell stories.")

    # the server's error is shown, and the message waits for an answer
    page.fill("#max-tokens", "100000")
    send(page, FRANCE)
    expect(page.locator("#error")).to_contain_text("'max_tokens' is 100000")
    expect(page.locator(".message")).to_have_count(5)

    # a new conversation; the old one stays in the list
    page.fill("#max-tokens", "12")
    page.click("#new-chat")
    send(page, FRANCE)
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".message.assistant .content")).to_contain_text("Paris")
    expect(page.locator("#conversations li")).to_have_count(2)


def test_page_asks_for_the_api_key(keyed, page):
    page.goto(url(keyed))
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#model-name")).to_have_text("(API key needed)")

    page.fill("#api-key", "wrong")
    page.click("#save-key")
    expect(page.locator("#key-note")).to_contain_text("refused")
    expect(page.locator("#key-form")).to_be_visible()

    page.fill("#api-key", KEY)
    page.click("#save-key")
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#model-name")).to_have_text("smol")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "12")
    send(page, FRANCE)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator(".message.assistant .content")).to_contain_text("Paris")

    # the key is kept: reloaded, the page asks no more
    page.reload()
    expect(page.locator("#model-name")).to_have_text("smol")
    expect(page.locator("#key-form")).to_be_hidden()
