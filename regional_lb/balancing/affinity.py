"""Session and prefix affinity: keep a conversation (or a shared prompt prefix) on the instance
that already holds its KV cache, unless that instance is too busy.

An inference server that has just served a conversation's previous turn, or any prompt with the
same long prefix (a system prompt, a document), can reuse that prefill (vLLM's and SGLang's
prefix caches): the affine instance answers sooner and spends less GPU. But pinning keys to
instances is how hot spots start, so affinity only holds under a load bound: consistent hashing
with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads",
SODA 2018). Each key ranks the instances by rendezvous hashing (highest random weight: stable
when instances join or leave, every instance equally likely first); the request goes to the
highest-ranked eligible instance whose load is within ``bound`` times the mean, where load is
the pick score (the time for the instance to finish its work and this request). With no
instance under the bound it goes where :func:`regional_lb.balancing.pick.pick` would send it anyway.

Pure: no clock, no I/O. :func:`rank` must give the same order on every balancer replica, so it
hashes with a fixed function, not Python's per-process ``hash``.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any

_MASK = (1 << 64) - 1


def key_of(text: str) -> int:
    """A 64-bit affinity key for a session id or a prompt prefix."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=4096)
def _salt(instance_id: str) -> int:
    return key_of(f"instance\x00{instance_id}")


def rank(key: int, instance_id: str) -> int:
    """The instance's weight for ``key`` (higher ranks first): splitmix64's finaliser over the
    key and the instance's salt, a few integer operations instead of a hash per instance."""
    z = (key ^ _salt(instance_id)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def prompt_prefix(body: dict[str, Any], chars: int) -> str | None:
    """The first ``chars`` characters of what the model reads first: chat messages in order
    (role and text), or the completion prompt / embedding input. None when there is none."""
    parts: list[str] = []
    size = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(
                    p.get("text", "") for p in content if isinstance(p, dict) and "text" in p
                )
            if not isinstance(content, str):
                continue
            piece = f"{message.get('role', '')}\x00{content}\x00"
            parts.append(piece)
            size += len(piece)
            if size >= chars:
                break
    else:
        prompt = body.get("prompt", body.get("input"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            parts.append(prompt)
    text = "".join(parts)[:chars]
    return text or None
