"""Prompt sets for ``tokenmesh bench``: synthetic (controlled lengths, shared-prefix groups) or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Short common English words: each is one token (with its leading space) in
# the Llama/SmolLM2 tokenizers, so N words is about N prompt tokens.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


class PromptError(ValueError):
    """The prompt set cannot be built or read."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request of the workload."""

    text: str = ""
    """A raw prompt (completion), or empty when messages are set."""
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) pairs for a chat request."""
    max_tokens: int = 128

    def tagged(self, tag: str) -> Prompt:
        """The same request with tag in front, so that two targets never share a KV-cache prefix."""
        if self.messages:
            (role, content), *rest = self.messages
            return Prompt(messages=((role, f"{tag} {content}"), *rest), max_tokens=self.max_tokens)
        return Prompt(text=f"{tag} {self.text}", max_tokens=self.max_tokens)


def synthetic(
    count: int, input_tokens: int, output_tokens: int, prefix_groups: int = 0, prefix_tokens: int = 0, seed: int = 0
) -> list[Prompt]:
    """Count raw prompts of about input_tokens tokens asking for output_tokens tokens.

    With prefix_groups > 0, prompt i starts with group (i mod prefix_groups)'s
    prefix of prefix_tokens tokens (a shared system prompt), then its own words.
    """
    if count < 1 or input_tokens < 1 or output_tokens < 1:
        raise PromptError("synthetic prompts need count, input and output tokens >= 1")
    if prefix_groups < 0 or prefix_tokens < 0 or prefix_tokens > input_tokens:
        raise PromptError(f"--prefix-tokens must be within 0..--input-tokens ({input_tokens}), groups >= 0")
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choices(WORDS, k=prefix_tokens)) for _ in range(prefix_groups)]
    prompts = []
    for i in range(count):
        own = " ".join(rng.choices(WORDS, k=input_tokens - (prefix_tokens if prefixes else 0)))
        text = f"{prefixes[i % prefix_groups]} {own}" if prefixes else own
        prompts.append(Prompt(text=text, max_tokens=output_tokens))
    return prompts


def read_jsonl(path: str, default_max_tokens: int) -> list[Prompt]:
    """One request per line: {"prompt": str} or {"messages": [{"role", "content"}]}, optional "max_tokens"."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"cannot read prompt file {path}: {exc}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise PromptError(f'{where}: expected an object with "prompt" or "messages"')
        max_tokens = item.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise PromptError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(item.get("prompt"), str) and item["prompt"]:
            prompts.append(Prompt(text=item["prompt"], max_tokens=max_tokens))
        elif isinstance(item.get("messages"), list) and item["messages"]:
            messages = item["messages"]
            if not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise PromptError(f'{where}: each message needs string "role" and "content"')
            prompts.append(Prompt(messages=tuple((m["role"], m["content"]) for m in messages), max_tokens=max_tokens))
        else:
            raise PromptError(f'{where}: needs a non-empty "prompt" string or "messages" list')
    if not prompts:
        raise PromptError(f"{path} holds no prompts")
    return prompts
