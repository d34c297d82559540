"""The bench's local engines, planned without starting any: D's KV size in tokens, and the
aggregated mode's own engine when D slices prefills."""

from __future__ import annotations

from pathlib import Path

from agentkv_server.bench.engines import KV_BLOCK_TOKENS, aggregated_twin, decode_kv_args
from agentkv_server.bundle.launcher import EngineProcess, EngineSpec
from agentkv_server.bundle.stack import StackConfig


def test_a_kv_size_in_tokens_is_whole_blocks_plus_vllms_null_block() -> None:
    assert decode_kv_args(None) == ()
    assert KV_BLOCK_TOKENS == 128
    assert decode_kv_args(8192) == ("--block-size", "128", "--num-gpu-blocks-override", "65")
    assert decode_kv_args(8193)[-1] == "66"  # rounded up to a whole block


def test_aggregated_runs_on_a_twin_of_d_without_its_slicing_or_reports(tmp_path: Path) -> None:
    """A slicing D would slice aggregated turns too, which vLLM does not do by default."""
    config = StackConfig(model=str(tmp_path), router=False, report_port=9123, log_dir=tmp_path)
    slicing = config.slice_args
    assert slicing == ("--long-prefill-token-threshold", "64")  # LocalPathSettings' default
    decode = EngineProcess(
        EngineSpec(
            role="decode",
            model=tmp_path,
            served_name="m",
            port=20001,
            side_channel_port=20002,
            log_path=tmp_path / "decode-1.log",
            cores="1",
            engine_args=(*slicing, *decode_kv_args(8192)),
            env={"AGENTKV_ROUTER_URL": "http://127.0.0.1:9123"},
        )
    )
    twin = aggregated_twin(decode, len(slicing), tmp_path).spec
    assert twin.engine_args == decode_kv_args(8192)  # the same memory, no slices
    assert twin.env == {} and twin.cores == "1" and twin.role == "decode"
    assert twin.port not in (20001, 20002) and twin.log_path == tmp_path / "aggregated.log"
    assert "--long-prefill-token-threshold" not in twin.command()
