"""One URL and TLS rule for a group's two peers (the coordinator, other groups' snapshot servers)."""

from __future__ import annotations

import ssl

import pytest

from ftlm.ft.http_client import Endpoint, EndpointError


def test_parse_reads_host_port_base_and_keeps_the_url() -> None:
    e = Endpoint.parse("http://10.0.0.7:8123/prefix/", token="t0k")
    assert (e.host, e.port, e.base, e.url, e.ssl_context) == ("10.0.0.7", 8123, "/prefix",
                                                              "http://10.0.0.7:8123/prefix", None)
    assert e.headers(Accept="x") == {"Accept": "x", "Authorization": "Bearer t0k"}
    assert Endpoint.parse("http://h:1").headers() == {}  # no token: no header


def test_https_is_verified_with_the_given_ca_or_else_the_systems() -> None:
    ctx = ssl.create_default_context()
    assert Endpoint.parse("https://h:443", ssl_context=ctx).ssl_context is ctx
    default = Endpoint.parse("https://h").ssl_context
    assert default is not None and default.verify_mode == ssl.CERT_REQUIRED and default.check_hostname
    assert Endpoint.parse("https://h").port == 443 and Endpoint.parse("http://h").port == 80


def test_a_process_configured_for_tls_never_talks_plain_http() -> None:
    with pytest.raises(EndpointError, match="plain http://") as info:
        Endpoint.parse("http://h:1", ssl_context=ssl.create_default_context())
    assert info.value.plain_with_tls


@pytest.mark.parametrize("url", ["ftp://h:1", "h:1", "http://:80", "http://h:99999", "http://h:x"])
def test_unusable_urls_are_refused(url: str) -> None:
    with pytest.raises(EndpointError) as info:
        Endpoint.parse(url)
    assert not info.value.plain_with_tls
