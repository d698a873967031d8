"""examples/llama_prefix.py on a real GPU (`pytest -m cuda`): a prefix restored from the host
tier, layer by layer (each decoder layer waits on the CUDA event of its own load) and as one
load, gives the greedy tokens of the prefix kept on the GPU, and the bytes back bit for bit."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

pytest.importorskip("transformers")

from examples.llama_prefix import run

pytestmark = pytest.mark.cuda

TIMEOUT_S = 120


def _config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    # Llama-3.1-8B's attention shapes (8 KV heads of 128: a 32 KiB K block of 16 tokens)
    # and rope, 4 layers of a narrower model.
    kwargs: dict[str, Any] = {
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 2048,
        "vocab_size": 4096,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "attn_implementation": "sdpa",
    }
    return LlamaConfig(**(kwargs | overrides))


def _check(result: dict[str, Any], *, layerwise: bool) -> None:
    assert result["device"].startswith("cuda") and result["dtype"] == "bfloat16"
    assert result["tokens_match"], result["tokens"]
    assert result["kv_bit_identical"]
    assert result["prefix_read_identical"]
    assert result["hit_blocks"] == result["prefix_blocks"]
    assert result["load_api"] == ("load_layers" if layerwise else "load")
    released = result["released"]
    assert released["transfers_in_flight"] == 0
    assert released["free_host_blocks"] == released["num_host_blocks"]
    assert released["manager_state"] == "closed" and released["chunks_leaked"] == 0
    assert released["free_gpu_blocks"] == released["num_gpu_blocks"]


@pytest.mark.parametrize("layerwise", [True, False])
async def test_tiny_llama_restored_on_the_gpu(layerwise: bool) -> None:
    with anyio.fail_after(TIMEOUT_S):
        result = await run("tiny", 200, suffix_tokens=24, device="cuda", layerwise=layerwise)
    _check(result, layerwise=layerwise)


@pytest.mark.parametrize("layerwise", [True, False])
async def test_llama_8b_attention_shapes_restored_on_the_gpu(layerwise: bool) -> None:
    """2,048 tokens of a prefix in 128 blocks of 16, 4 layers: 128 transfers' worth of
    32 KiB blocks per layer group, against the forward that waits for them."""
    with anyio.fail_after(TIMEOUT_S):
        result = await run(
            _config(), 2048, suffix_tokens=64, new_tokens=16, device="cuda", layerwise=layerwise
        )
    _check(result, layerwise=layerwise)
    assert result["host_block_bytes"] == 4 * 2 * 32768
