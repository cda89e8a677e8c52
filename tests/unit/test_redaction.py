"""The redactor: every kind of value replaced, also when split across two chunks at any position; plain text kept."""

from __future__ import annotations

import pytest

from tokenmesh.redaction import StreamRedactor, redact

VALUES = {
    "EMAIL": ["alice.smith+ml@example.co.uk", "bob@mail.example.org"],
    "PHONE": ["+1 415-555-0132", "(020) 7946 0958", "+44 20 7946 0958"],
    "CARD": ["4111 1111 1111 1111", "5500-0000-0000-0004", "378282246310005"],
    "IBAN": ["DE89 3704 0044 0532 0130 00", "GB82WEST12345698765432"],
    "IP": ["192.168.10.254", "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "fe80::1ff:fe23:4567:890a"],
    "SECRET": [
        "sk-proj-4fG7hK2mN9pQ3rS6tV8wX1yZ",
        "ghp_A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
        "AKIAIOSFODNN7EXAMPLE",
        "xoxb-123456789012-abcdefABCDEF",
        "d8e8fca2dc0f896fd7cb4cb0031ba249Q7",
    ],
}
PLAIN = [
    "The capital of France is Paris.",
    "In 1998 there were 42 apples, 3.5 pears and 17 plums; see chapter 12, page 345.",
    "Version 2.51.0 shipped on 2024-08-01 with 4096 tokens of context.",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa is not a secret, nor is supercalifragilisticexpialidocious.",
]
CASES = [(kind, value) for kind, values in VALUES.items() for value in values]


@pytest.mark.parametrize(("kind", "value"), CASES)
def test_each_value_is_replaced_whole_and_anywhere_split(kind: str, value: str) -> None:
    text = f"Contact: {value} please."
    assert redact(text) == f"Contact: <{kind}> please."
    for cut in range(1, len(text)):
        redactor = StreamRedactor()
        first = redactor.feed(text[:cut])
        second = redactor.feed(text[cut:])
        rest = redactor.flush()
        assert value not in first + second + rest
        assert first + second + rest == f"Contact: <{kind}> please.", cut
        for part in (first, second):  # nothing released before it was decided: no piece of the value leaks
            assert not (len(value) > 4 and any(value[i : i + 5] in part for i in range(len(value) - 4)))


@pytest.mark.parametrize("text", PLAIN)
def test_ordinary_text_is_unchanged_however_it_streams(text: str) -> None:
    assert redact(text) == text
    redactor = StreamRedactor()
    assert "".join(redactor.feed(c) for c in text) + redactor.flush() == text


def test_checks_keep_numbers_that_are_not_cards_or_ibans() -> None:
    assert redact("order 4111 1111 1111 1112 shipped") == "order 4111 1111 1111 1112 shipped"  # fails Luhn
    assert redact("code DE00 3704 0044 0532 0130 00 here") == "code DE00 3704 0044 0532 0130 00 here"  # mod 97
