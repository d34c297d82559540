"""Prefix fingerprints: how a prefill engine checks which held KV really matches its prompt.

A decode engine that retains a request's blocks describes the tokens they hold with a chain
of block hashes (each hash covers one full block and everything before it) plus the raw ids
of the last, partial block. A prefill engine hashes its own prompt the same way and loads
only the longest prefix on which both agree, so a follow-up whose history was edited
(reasoning stripped, a message changed: vLLM issue #43094) never loads KV computed for other
tokens. A 128-bit chained digest makes an accidental match of a different prefix as likely
as a BLAKE2 collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from agentkv_server.wire import BLOCK_HASHES, HASH_BLOCK_SIZE, TAIL_TOKEN_IDS

__all__ = ["PrefixFingerprint", "block_hashes", "common_prefix_tokens"]

_DIGEST_BYTES: Final = 16
_ROOT: Final = b"agentkv-prefix-v1"


def _chain(token_ids: Sequence[int], block_size: int) -> Iterator[str]:
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        # Little-endian 64-bit ids: the same bytes on every host that hashes them.
        digest = hashlib.blake2b(
            parent + struct.pack(f"<{block_size}q", *block), digest_size=_DIGEST_BYTES
        ).digest()
        parent = digest
        yield digest.hex()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[str]:
    """Chained hashes of every full ``block_size`` block of ``token_ids``, in order."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return list(_chain(token_ids, block_size))


@dataclass(frozen=True)
class PrefixFingerprint:
    """What a holder tells others about the tokens its blocks hold."""

    block_size: int
    block_hashes: tuple[str, ...]
    tail_token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Tokens described: full blocks plus the partial tail."""
        return len(self.block_hashes) * self.block_size + len(self.tail_token_ids)

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int) -> PrefixFingerprint:
        """Fingerprint the held ``token_ids``."""
        hashes = block_hashes(token_ids, block_size)
        tail = token_ids[len(hashes) * block_size :]
        return cls(block_size, tuple(hashes), tuple(tail))

    def to_params(self) -> dict[str, Any]:
        """The fields added to ``kv_transfer_params`` (JSON-safe)."""
        return {
            HASH_BLOCK_SIZE: self.block_size,
            BLOCK_HASHES: list(self.block_hashes),
            TAIL_TOKEN_IDS: list(self.tail_token_ids),
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PrefixFingerprint | None:
        """Read a fingerprint back; ``None`` when absent or malformed (then nothing is trusted)."""
        try:
            block_size = int(params[HASH_BLOCK_SIZE])
            hashes = tuple(str(h) for h in params[BLOCK_HASHES])
            tail = tuple(int(t) for t in params[TAIL_TOKEN_IDS])
        except (KeyError, TypeError, ValueError):
            return None
        if block_size < 1 or len(tail) >= block_size:
            return None
        return cls(block_size, hashes, tail)


def common_prefix_tokens(fingerprint: PrefixFingerprint, token_ids: Sequence[int]) -> int:
    """Length of the longest prefix of ``token_ids`` that the fingerprinted tokens share,
    counted in whole blocks, plus the partial tail when every full block and the tail match.

    Loading a block copies all of it, so a block that matches only in part is never counted.
    """
    size = fingerprint.block_size
    matched = 0
    for held, own in zip(fingerprint.block_hashes, _chain(token_ids, size)):
        if held != own:
            return matched * size
        matched += 1
    end = matched * size
    if matched < len(fingerprint.block_hashes):
        return end  # the prompt is shorter than the held full blocks
    tail = fingerprint.tail_token_ids
    if tail and tuple(token_ids[end : end + len(tail)]) == tail:
        return end + len(tail)
    return end
