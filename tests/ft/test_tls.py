"""TLS contexts (ftlm.ft.tls) and the ft.tls_* config fields: bad files are one-line ConfigErrors.

End-to-end transfers over TLS live in test_transport.py.
"""

from __future__ import annotations

import ssl

import pytest

from ftlm.errors import ConfigError
from ftlm.ft.config import FTConfig
from ftlm.ft.tls import client_context, server_context


def test_contexts_from_valid_files_verify_by_default(tls_files):
    server = server_context(tls_files.cert, tls_files.key)
    client = client_context(tls_files.ca)

    assert server.minimum_version >= ssl.TLSVersion.TLSv1_2
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    opted_out = client_context(tls_files.ca, check_hostname=False)
    assert opted_out.verify_mode == ssl.CERT_REQUIRED and not opted_out.check_hostname


def test_missing_or_unusable_files_are_config_errors_naming_the_path(tls_files, tmp_path):
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello\n")
    missing = tmp_path / "missing.pem"

    cases = [
        (lambda: server_context(missing, tls_files.key), "missing.pem' does not exist"),
        (lambda: server_context(tls_files.cert, missing), "missing.pem' does not exist"),
        (lambda: server_context(not_pem, tls_files.key), "not.pem' .*cannot be used"),
        # The CA's certificate with the server's key: a key that does not belong to it.
        (lambda: server_context(tls_files.ca, tls_files.key), "ca.pem' .*cannot be used"),
        (lambda: client_context(missing), "missing.pem' does not exist"),
        (lambda: client_context(not_pem), "not.pem' cannot be used"),
    ]
    for make, problem in cases:
        with pytest.raises(ConfigError, match=problem) as e:
            make()
        assert "\n" not in str(e.value)


def test_ft_config_tls_fields_are_validated(tls_files, tmp_path):
    config = FTConfig(tls_cert=str(tls_files.cert), tls_key=str(tls_files.key),
                      tls_ca=str(tls_files.ca))
    assert config.tls_ca == str(tls_files.ca)
    assert FTConfig().tls_cert == FTConfig().tls_key == FTConfig().tls_ca == ""

    with pytest.raises(ConfigError, match="set both"):
        FTConfig(tls_cert=str(tls_files.cert))
    with pytest.raises(ConfigError, match="set both"):
        FTConfig(tls_key=str(tls_files.key), tls_ca=str(tls_files.ca))
    with pytest.raises(ConfigError, match=r"ft.tls_ca='.*nope.pem' must be the path of an "
                                          r"existing PEM file"):
        FTConfig(tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="ft.tls_cert=3"):
        FTConfig(tls_cert=3, tls_key=str(tls_files.key))
