"""Hand-written bad input against the real gateway: invalid UTF-8, deeply nested JSON, a
100 MB body, negative and huge numbers, unknown fields, content types, and slow-loris
clients. Each gets a clear error in the API's own shape (or, for unknown fields, is
served), never a 5xx, a hang or a dead process."""
import json
import socket
import time

import pytest

from test_api import MODEL, running_cluster

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("bad")) as c:
        yield c


def raw(cluster, path, body, content_type="application/json", headers=None, timeout=30):
    """POSTs raw bytes; returns (status, parsed JSON body or text)."""
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=timeout) as s:
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}",
                "Connection: close"]
        if content_type:
            head.append(f"Content-Type: {content_type}")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        return read_response(s)


def read_response(s):
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")


def dechunk(body):
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return out


def openai_error(status, body, code=400):
    assert status == code, (status, body)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def anthropic_error(status, body, code=400):
    assert status == code, (status, body)
    assert body["type"] == "error" and body["error"]["message"], body
    return body["error"]["message"]


def chat(**fields):
    return json.dumps({"model": MODEL, "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_invalid_utf8_is_a_clear_400_in_each_shape(cluster):
    body = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "messages": ' \
        b'[{"role": "user", "content": "caf\xe9 \xff\xfe"}]}'
    assert "not valid JSON" in openai_error(*raw(cluster, CHAT, body))
    assert "not valid JSON" in anthropic_error(*raw(cluster, MESSAGES, body))


def test_deeply_nested_json_is_refused_without_a_stack_overflow(cluster):
    for depth in (200, 100_000):
        body = b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}"
        message = openai_error(*raw(cluster, CHAT, body))
        assert "not valid JSON" in message or "invalid" in message, message
    assert cluster.health()[0] == 200


def test_a_body_of_millions_of_tiny_values_is_a_413_before_any_tree_is_built(cluster):
    # 5M empty objects in 15 MB: parsed into a JSON tree they cost ~40x the body. Counted in
    # one pass over the bytes and refused, in each API's shape; an unknown field of that kind
    # too (the typed decoders would skip it, but it is the same cost to read).
    parts = b"[" + b",".join([b"{}"] * 5_000_000) + b"]"
    oai = b'{"model": "' + MODEL.encode() + b'", "max_tokens": 4, "messages": ' \
        b'[{"role": "user", "content": ' + parts + b"}]}"
    assert "JSON values" in openai_error(*raw(cluster, CHAT, oai), code=413)
    assert "JSON values" in anthropic_error(*raw(cluster, MESSAGES, oai), code=413)
    unknown = chat(x=[0] * 2_000_000)
    assert "JSON values" in openai_error(*raw(cluster, CHAT, unknown), code=413)
    # A request with many values (a history of 501 short messages) is served.
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": "ok"}
               for i in range(501)]
    status, body = raw(cluster, CHAT, chat(messages=history))
    assert status == 200, body


def test_a_100_mb_body_is_refused_early_with_413(cluster):
    size = 100 << 20
    with socket.create_connection(("127.0.0.1", cluster.port), timeout=30) as s:
        s.sendall((f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode())
        started = time.monotonic()
        sent = 0
        try:
            # Keep sending until the server answers and closes; it must not read 100 MB.
            while sent < size:
                s.sendall(b" " * (1 << 20))
                sent += 1 << 20
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, body = read_response(s)
    assert status == 413, (status, body)
    assert "larger than" in body["error"]["message"]
    assert sent < size, "the server read the whole 100 MB before refusing"
    print(f"\n413 after {sent >> 20} MiB sent, {time.monotonic() - started:.2f} s")


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 10**30), ("max_tokens", 1.5),
    ("temperature", -5), ("temperature", 1e308), ("top_p", 2), ("top_p", -0.1),
    ("n", 1000), ("seed", -1), ("presence_penalty", 1e9), ("top_k", -3),
    ("max_tokens", "12"), ("messages", 7), ("stop", 3),
])
def test_negative_huge_and_mistyped_numbers_are_400s_naming_the_field(cluster, field, value):
    message = openai_error(*raw(cluster, CHAT, chat(**{field: value})))
    assert field in message, message


def test_anthropic_numbers_are_checked_too(cluster):
    for fields in ({"max_tokens": -1}, {"max_tokens": 10**20}, {"temperature": -1},
                   {"top_k": -2}):
        body = json.dumps({"model": MODEL, "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hi"}], **fields}).encode()
        message = anthropic_error(*raw(cluster, MESSAGES, body))
        assert next(iter(fields)) in message, message


def test_unknown_fields_are_ignored_as_the_real_apis_do(cluster):
    status, body = raw(cluster, CHAT, chat(some_future_option={"x": [1, 2]}, user="u-1",
                                           temperature=0))
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] is not None


def test_content_types(cluster):
    # A body must be declared JSON: a web page can POST text/plain or a form anywhere without
    # a CORS preflight, so those are refused before any handler (curl -d sends a form: the
    # message says what to add).
    for content_type in ("application/x-www-form-urlencoded", "text/plain", "image/png", None):
        status, body = raw(cluster, CHAT, chat(temperature=0), content_type=content_type)
        assert status == 415, (content_type, body)
        assert "Content-Type: application/json" in body["error"]["message"]
    status, body = raw(cluster, "/v1/messages", b"{}", content_type="text/plain")
    assert status == 415 and body["type"] == "error", body
    # Declared JSON with parameters is JSON; something that is not JSON is a 400.
    status, body = raw(cluster, CHAT, chat(temperature=0),
                       content_type="application/json; charset=utf-8")
    assert status == 200, body
    assert "not valid JSON" in openai_error(*raw(cluster, CHAT, b"model=m&messages=x",
                                                 content_type="application/json"))
    assert "empty" in openai_error(*raw(cluster, CHAT, b"", content_type=None))


def test_slow_loris_clients_do_not_starve_others_and_are_cut_off(cluster):
    # 64 clients that send their headers a line at a time, slowly, and never finish them.
    connected = time.monotonic()
    slow = []
    for _ in range(64):
        s = socket.create_connection(("127.0.0.1", cluster.port), timeout=5)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.append(s)
    try:
        for i in range(3):
            for s in slow:
                try:
                    s.sendall(b"X-Slow-%d: y\r\n" % i)
                except OSError:
                    pass
            # A well-behaved client is served meanwhile, and promptly.
            started = time.monotonic()
            status, body = raw(cluster, CHAT, chat(temperature=0), timeout=60)
            assert status == 200, body
            assert time.monotonic() - started < 30
            time.sleep(1)
        # The server closes them once the header read timeout (10 s) has passed.
        for s in slow:
            s.settimeout(max(1.0, connected + 20 - time.monotonic()))
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - connected < 20
    finally:
        for s in slow:
            s.close()
    assert cluster.health()[0] == 200


def tool(name):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


def test_per_request_limits_are_clear_400s_in_each_shape(cluster):
    # Tools: a count bound, and duplicate names found by a set (20K tools took 0.56 s when
    # each name was compared with every earlier one).
    many = [tool(f"t{i}") for i in range(20_000)]
    started = time.monotonic()
    message = openai_error(*raw(cluster, CHAT, chat(tools=many)))
    assert "at most 1024" in message and time.monotonic() - started < 10, message
    dup = [tool(f"t{i}") for i in range(1000)] + [tool("t7")]
    assert "used twice" in openai_error(*raw(cluster, CHAT, chat(tools=dup)))
    anthropic = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(1025)]
    body = json.dumps({"model": MODEL, "max_tokens": 4, "tools": anthropic,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert "at most 1024" in anthropic_error(*raw(cluster, MESSAGES, body))
    # Messages, stop sequences, top_logprobs.
    msgs = [{"role": "user", "content": "hi"}] * 10_001
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": msgs}).encode()
    assert "at most 10000" in openai_error(*raw(cluster, CHAT, body))
    assert "at most 10000" in anthropic_error(*raw(cluster, MESSAGES, body))
    assert "at most 16 stop" in openai_error(*raw(cluster, CHAT, chat(stop=["x"] * 17)))
    assert "1024 bytes" in openai_error(*raw(cluster, CHAT, chat(stop=["x" * 1025])))
    message = openai_error(*raw(cluster, CHAT, chat(logprobs=True, top_logprobs=21)))
    assert "top_logprobs" in message and "at most 20" in message
    # The server is unharmed.
    status, body = raw(cluster, CHAT, chat(temperature=0))
    assert status == 200, body
