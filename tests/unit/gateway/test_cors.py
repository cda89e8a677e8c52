"""The gateway's CORS policy: only listed origins get Access-Control-Allow-Origin, preflights answered for them."""

from __future__ import annotations

import pytest

from tokenmesh_gateway import HttpError
from tokenmesh_gateway._cors import EXPOSED, Cors, origin_error

APP = "https://app.example"
LOCAL = "http://localhost:5173"


def test_a_listed_origin_gets_itself_back_never_a_wildcard() -> None:
    cors = Cors([APP, LOCAL])
    assert cors.headers(APP.encode()) == [
        (b"access-control-allow-origin", APP.encode()),
        (b"access-control-expose-headers", EXPOSED),
        (b"vary", b"origin"),
    ]
    assert dict(cors.headers(LOCAL.encode()))[b"access-control-allow-origin"] == LOCAL.encode()


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.example",
        "http://app.example",  # another scheme is another origin
        "https://app.example:8443",  # so is another port
        "https://app.example.evil.example",
        "null",  # a sandboxed page or a file://
    ],
)
def test_any_other_origin_gets_no_allow_origin_but_vary(origin: str) -> None:
    assert Cors([APP]).headers(origin.encode()) == [(b"vary", b"origin")]


def test_a_request_without_origin_gets_no_cors_header() -> None:
    assert Cors([APP]).headers(None) == []


def test_listed_origins_compare_as_browsers_send_them_in_lower_case() -> None:
    cors = Cors(["https://App.Example"])
    assert dict(cors.headers(b"https://app.example"))[b"access-control-allow-origin"] == b"https://app.example"


def test_a_preflight_of_a_listed_origin_gets_the_paths_methods_and_the_asked_headers() -> None:
    headers = dict(Cors([APP]).preflight(APP.encode(), "POST", b"authorization, content-type, x-stainless-os"))
    assert headers == {
        b"access-control-allow-methods": b"POST",
        b"access-control-max-age": b"600",
        b"access-control-allow-headers": b"authorization, content-type, x-stainless-os",
    }
    assert b"access-control-allow-headers" not in dict(Cors([APP]).preflight(APP.encode(), "GET", None))


@pytest.mark.parametrize("origin", [b"https://evil.example", None])
def test_a_preflight_of_another_origin_is_403_naming_the_setting(origin: bytes | None) -> None:
    with pytest.raises(HttpError) as refused:
        Cors([APP]).preflight(origin, "POST", b"content-type")
    assert refused.value.status == 403 and refused.value.code == "cors_origin_not_allowed"
    assert "--cors-origins" in refused.value.message


def test_a_preflight_asking_for_something_other_than_header_names_is_400() -> None:
    with pytest.raises(HttpError) as refused:
        Cors([APP]).preflight(APP.encode(), "POST", b"content-type\r\nx-injected: 1")
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("origin", "valid"),
    [
        (APP, True),
        (LOCAL, True),
        ("http://[::1]:8080", True),
        ("https://app.example/", False),
        ("https://app.example/path", False),
        ("app.example", False),
        ("ftp://app.example", False),
        ("*", False),
        ("null", False),
    ],
)
def test_an_origin_setting_is_scheme_host_and_port_only(origin: str, valid: bool) -> None:
    assert (origin_error(origin) == "") is valid
