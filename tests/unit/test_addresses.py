"""L1/L7: where a request goes on a backend, from its `proxy`: a bare origin takes the
request path whole; a URL with a path is an OpenAI-style base URL that already carries its
version, so the request's `/v1` is not repeated; `${PORT}` is the port corrallm picked."""

from __future__ import annotations

import pytest

from corrallm.lifecycle.addresses import origin, resolve_url, upstream_url


@pytest.mark.parametrize(
    ("proxy", "port", "base"),
    [
        ("5800", None, "http://127.0.0.1:5800"),
        ("${PORT}", 4242, "http://127.0.0.1:4242"),
        ("http://127.0.0.1:${PORT}", 4242, "http://127.0.0.1:4242"),
        ("http://localhost:${PORT}/v1/", 4242, "http://localhost:4242/v1"),
        ("https://api.openai.com/", None, "https://api.openai.com"),
    ],
)
def test_L1_proxy_resolves_to_a_base_url(proxy, port, base):
    assert resolve_url(proxy, port) == base


@pytest.mark.parametrize(
    ("base", "path", "url"),
    [
        (
            "http://127.0.0.1:5800",
            "/v1/chat/completions",
            "http://127.0.0.1:5800/v1/chat/completions",
        ),
        ("https://api.openai.com", "/v1/embeddings", "https://api.openai.com/v1/embeddings"),
        (
            "http://127.0.0.1:5800/v1",
            "/v1/chat/completions",
            "http://127.0.0.1:5800/v1/chat/completions",
        ),
        (
            "https://api.groq.com/openai/v1",
            "/v1/chat/completions",
            "https://api.groq.com/openai/v1/chat/completions",
        ),
        (
            "https://g.test/v1beta/openai",
            "/v1/chat/completions",
            "https://g.test/v1beta/openai/chat/completions",
        ),
        ("https://g.test/v1beta/openai", "/rerank", "https://g.test/rerank"),
    ],
)
def test_L7_a_base_url_with_a_path_is_not_given_v1_twice(base, path, url):
    assert upstream_url(base, path) == url


def test_L1_health_and_the_backends_own_pages_live_at_its_origin():
    assert origin("http://127.0.0.1:4242/v1") == "http://127.0.0.1:4242"
    assert origin("https://api.groq.com/openai/v1") == "https://api.groq.com"
