"""Prefix fingerprints: a prefill engine loads only what its prompt really shares."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentkv_server.connector.prefix import (
    PrefixFingerprint,
    block_hashes,
    common_prefix_tokens,
)

HELD = list(range(100, 170))  # 70 tokens: 4 full blocks of 16 and a tail of 6


def fingerprint(tokens: list[int] = HELD, block_size: int = 16) -> PrefixFingerprint:
    return PrefixFingerprint.of(tokens, block_size)


def test_fingerprint_covers_full_blocks_and_tail() -> None:
    fp = fingerprint()
    assert len(fp.block_hashes) == 4
    assert fp.tail_token_ids == tuple(HELD[64:])
    assert fp.num_tokens == len(HELD)


def test_hashes_are_chained_so_a_block_commits_to_everything_before_it() -> None:
    edited = [HELD[0] + 1, *HELD[1:]]
    original, changed = block_hashes(HELD, 16), block_hashes(edited, 16)
    assert all(a != b for a, b in zip(original, changed))


def test_prompt_that_extends_the_held_tokens_loads_all_of_them() -> None:
    assert common_prefix_tokens(fingerprint(), [*HELD, 1, 2, 3]) == len(HELD)


def test_identical_prompt_loads_all_held_tokens() -> None:
    assert common_prefix_tokens(fingerprint(), HELD) == len(HELD)


@pytest.mark.parametrize(
    ("position", "expected"),
    [(0, 0), (15, 0), (16, 16), (40, 32), (63, 48), (64, 64), (69, 64)],
)
def test_edit_clips_to_the_last_whole_block_before_it(position: int, expected: int) -> None:
    prompt = list(HELD) + [7, 7]
    prompt[position] += 1
    assert common_prefix_tokens(fingerprint(), prompt) == expected


def test_prompt_shorter_than_the_holding_loads_only_its_whole_blocks() -> None:
    assert common_prefix_tokens(fingerprint(), HELD[:40]) == 32
    assert common_prefix_tokens(fingerprint(), HELD[:66]) == 64  # the tail only in part


def test_holding_of_whole_blocks_only() -> None:
    fp = fingerprint(HELD[:64])
    assert fp.tail_token_ids == ()
    assert common_prefix_tokens(fp, HELD) == 64


def test_params_round_trip_through_json() -> None:
    fp = fingerprint()
    wire = json.loads(json.dumps(fp.to_params()))
    assert PrefixFingerprint.from_params(wire) == fp


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"agentkv_hash_block_size": 16, "agentkv_block_hashes": ["ab"]},
        {"agentkv_hash_block_size": 0, "agentkv_block_hashes": [], "agentkv_tail_token_ids": []},
        {
            "agentkv_hash_block_size": 4,
            "agentkv_block_hashes": [],
            "agentkv_tail_token_ids": [1] * 4,
        },
        {"agentkv_hash_block_size": "x", "agentkv_block_hashes": [], "agentkv_tail_token_ids": []},
        {"agentkv_hash_block_size": 16, "agentkv_block_hashes": None, "agentkv_tail_token_ids": []},
    ],
)
def test_malformed_fingerprint_is_not_trusted(params: dict) -> None:
    assert PrefixFingerprint.from_params(params) is None


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_hashes(HELD, 0)


tokens = st.lists(st.integers(min_value=0, max_value=2**31), max_size=80)


@given(held=tokens, prompt=tokens, block_size=st.integers(min_value=1, max_value=9))
def test_loaded_prefix_is_always_really_shared(
    held: list[int], prompt: list[int], block_size: int
) -> None:
    loaded = common_prefix_tokens(PrefixFingerprint.of(held, block_size), prompt)
    assert held[:loaded] == prompt[:loaded]
    assert loaded <= min(len(held), len(prompt))
    assert loaded % block_size == 0 or loaded == len(held)


@given(held=tokens, extra=tokens, block_size=st.integers(min_value=1, max_value=9))
def test_every_held_token_loads_when_the_prompt_extends_them(
    held: list[int], extra: list[int], block_size: int
) -> None:
    fp = PrefixFingerprint.of(held, block_size)
    assert common_prefix_tokens(fp, held + extra) == len(held)
