"""The KV tier on a real model (examples/llama_prefix.py), on the CPU with a tiny Llama:
request 2's prefix restored from the host gives the greedy tokens of the prefix kept on
the device, the restored blocks are the kept ones bit for bit, the lookup hits every full
block of the shared prefix, and the manager and the tier give everything back."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import structlog
import torch

pytest.importorskip("transformers")

from asyncpin import KVLayout, OffloadManager
from asyncpin.tier import KVTier
from examples import llama_prefix
from examples.llama_prefix import (
    PrefixEngine,
    build_model,
    llama_config,
    prefix_hashes,
    run,
    serve,
)
from tests.helpers import TIMEOUT_S

pytestmark = pytest.mark.anyio

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def collected() -> Iterator[None]:
    """Models and caches in reference cycles are freed now, not by a garbage collection
    during a later test that counts this process's mappings (tests/helpers.refused)."""
    yield
    gc.collect()


def _check(result: dict[str, Any], *, prompt: int, block_size: int, layerwise: bool) -> None:
    blocks = prompt // block_size
    assert result["tokens_match"], result["tokens"]
    assert result["kv_bit_identical"]
    assert result["prefix_read_identical"]
    assert result["prefix_blocks"] == blocks
    assert result["hit_blocks"] == blocks and result["kept_blocks"] == blocks
    assert len(result["tokens"]["restored"]) == result["new_tokens"]
    layers = result["layers"]
    assert result["loaded_bytes"] == blocks * result["host_block_bytes"]
    assert result["host_block_bytes"] == 2 * layers * block_size * 2 * 16 * 4  # fp32, 2 heads
    # One transfer per layer (its K and V) when asked; else one load.
    assert result["load_api"] == ("load_layers" if layerwise else "load")
    assert result["load_transfers"] == (layers if layerwise else 1)
    released = result["released"]
    assert released["transfers_in_flight"] == 0
    assert released["free_host_blocks"] == released["num_host_blocks"]
    assert released["manager_state"] == "closed"
    assert released["pinned_bytes"] == 0 and released["chunks_leaked"] == 0
    assert released["free_gpu_blocks"] == released["num_gpu_blocks"]
    # Timings are there (not checked: the CPU says nothing about a GPU's).
    assert set(result["ttft_s"]) == {"full", "restored", "kept"}


@pytest.mark.parametrize(
    ("block_size", "prompt", "suffix", "layerwise"),
    [(4, 37, 7, True), (16, 64, 20, True), (16, 70, 1, False)],
)
async def test_restored_prefix_gives_the_kept_tokens_and_bytes(
    block_size: int, prompt: int, suffix: int, layerwise: bool
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        result = await run(
            "tiny",
            prompt,
            suffix_tokens=suffix,
            new_tokens=6,
            block_size=block_size,
            device="cpu",
            layerwise=layerwise,
        )
    _check(result, prompt=prompt, block_size=block_size, layerwise=layerwise)
    assert result["prompt_tokens"] == prompt // block_size * block_size + suffix


async def test_the_restored_prefix_is_what_the_model_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool blocks gathered into the cache feed the forward: had they been zeros, the
    tokens would differ (so matching tokens do say that the restored KV was used)."""
    kwargs: dict[str, Any] = {"suffix_tokens": 5, "new_tokens": 6, "block_size": 4, "device": "cpu"}
    real = (await run("tiny", 40, **kwargs))["tokens"]["kept"]

    def zeros(self: PrefixEngine, layer: int, index: Any, keys: Any, values: Any) -> None:
        keys.zero_()
        values.zero_()

    monkeypatch.setattr(PrefixEngine, "gather", zeros)
    assert (await run("tiny", 40, **kwargs))["tokens"]["kept"] != real


async def test_a_miss_prefills_everything() -> None:
    """Nothing on the host: lookup hits 0 blocks, nothing is loaded, the whole prompt is
    prefilled (exactly as a full prefill: same tokens)."""
    model = build_model(llama_config("tiny"), CPU, torch.float32)
    engine = PrefixEngine(model, block_size=4, num_gpu_blocks=8)
    prompt = list(range(1, 23))
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(KVLayout.from_tensors(engine.kv_tensors), 4) as mgr:
            tier = KVTier(mgr)
            host = await serve(engine, tier, prompt, mode="host", new_tokens=4)
            full = await serve(engine, None, prompt, mode="full", new_tokens=4)
            assert mgr.stats().transfers_loaded == 0
    assert (host.hit_blocks, host.block_ids, host.load_api) == (0, [], None)
    assert host.tokens == full.tokens
    assert engine.free_blocks == engine.num_gpu_blocks


async def test_a_prompt_of_whole_blocks_keeps_its_last_token_to_prefill() -> None:
    """Request 2 = request 1's blocks exactly: its last block is not restored (its last
    token's logits are the first token's), the blocks before it are."""
    model = build_model(llama_config("tiny"), CPU, torch.float32)
    engine = PrefixEngine(model, block_size=4, num_gpu_blocks=16)
    prompt = list(range(7, 7 + 16))
    with anyio.fail_after(TIMEOUT_S):
        async with OffloadManager.for_kv(KVLayout.from_tensors(engine.kv_tensors), 8) as mgr:
            tier = KVTier(mgr)
            hashes, _ = await llama_prefix.prefill_and_offload(engine, tier, prompt)
            kept = await serve(engine, tier, prompt, mode="kept", new_tokens=3)
            engine.drop_prefix(hashes)
            restored = await serve(engine, tier, prompt, mode="host", new_tokens=3)
            engine.free(restored.block_ids)
    assert len(hashes) == 4 and kept.hit_blocks == restored.hit_blocks == 3
    assert restored.tokens == kept.tokens


@pytest.mark.parametrize("layerwise", [True, False])
def test_each_layer_waits_for_its_own_load_then_gathers(
    monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """The CUDA wiring without a GPU: a stand-in stream records the waits. Layer-wise,
    layer i's hook waits for event i, gathers layer i, and layer i runs before layer i + 1
    waits; with one load, layer 0 waits for it and nothing else does."""
    model = build_model(llama_config("tiny"), CPU, torch.float32)
    engine = PrefixEngine(model, block_size=4, num_gpu_blocks=8)
    for t in engine.kv_tensors:
        t.normal_()
    log: list[tuple[str, object]] = []

    class Stream:
        def wait_event(self, event: object) -> None:
            log.append(("wait", event))

    real_gather = PrefixEngine.gather

    def gather(self: PrefixEngine, layer: int, index: Any, keys: Any, values: Any) -> None:
        log.append(("gather", layer))
        real_gather(self, layer, index, keys, values)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(PrefixEngine, "gather", gather)
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda *_, i=i: log.append(("ran", i)))
    cache, keys, values = engine.prefix_cache(8)
    events = ["ev0", "ev1"] if layerwise else ["ev", None]
    with engine.restoring(engine.index_of([3, 5]), keys, values, events):
        engine.forward([1, 2, 3], cache)
    if layerwise:
        expected = [("wait", "ev0"), ("gather", 0), ("ran", 0)]
        expected += [("wait", "ev1"), ("gather", 1), ("ran", 1)]
    else:
        expected = [("wait", "ev"), ("gather", 0), ("ran", 0), ("gather", 1), ("ran", 1)]
    assert log == expected
    # The gathered blocks are pool blocks 3 and 5, token-major: [1, heads, 8, dim].
    for pool, out in ((engine.k[1], keys[1]), (engine.v[0], values[0])):
        want = torch.cat([pool[3], pool[5]], dim=1).unsqueeze(0)
        assert torch.equal(out, want)
    assert cache.get_seq_length() == 8 + 3  # the prefix, then the prompt's own tokens


def test_prefix_hashes_chain() -> None:
    a = prefix_hashes(list(range(10)), 4)
    assert len(a) == 2 and len(set(a)) == 2
    assert prefix_hashes([*range(8), 99, 98], 4) == a  # a partial block is not hashed
    assert prefix_hashes([*range(8), 99, 98, 97, 96], 4)[:2] == a
    changed = prefix_hashes([1, *range(1, 10)], 4)
    assert changed[0] != a[0] and changed[1] != a[1]  # a block's hash covers its prefix
    assert all(isinstance(h, int) for h in a)


@pytest.fixture
def structlog_config() -> Iterator[None]:
    """The command line configures structlog (its logs to stderr): put it back after."""
    configured, config = structlog.is_configured(), structlog.get_config()
    yield
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()


@pytest.mark.usefixtures("structlog_config")
def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = "--tokens 24 --block-size 8 --suffix 3 --new-tokens 3 --device cpu --json"
    llama_prefix.main(args.split())
    result = json.loads(capsys.readouterr().out)
    assert result["tokens_match"] and result["kv_bit_identical"] and result["hit_blocks"] == 3
    assert result["load_api"] == "load_layers"


@pytest.mark.usefixtures("structlog_config")
def test_the_8b_config_needs_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        llama_prefix.main(["--config", "llama-3.1-8b", "--device", "cpu"])
    assert info.value.code == 2
    assert "runs on a CUDA GPU" in capsys.readouterr().err


def test_the_8b_config_is_llama_3_1_8b() -> None:
    cfg = llama_config("llama-3.1-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (4096, 32, 32)
    assert (cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (8, 14336, 128256)
    assert cfg.max_position_embeddings == 131072
    rope = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    assert theta == 500000.0
    # One K block of one layer: 8 heads x 16 tokens x 128 x bf16 = 32 KiB.
    assert cfg.num_key_value_heads * 16 * (cfg.hidden_size // cfg.num_attention_heads) * 2 == 32768
