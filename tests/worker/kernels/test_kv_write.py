"""write_kv against index_copy_ into the flattened cache (runs under the Triton interpreter without a GPU)."""
import pytest
import torch

from tests.worker.kernels.paged_reference import DEVICE
from tests.worker.kernels.tolerances import assert_close
from worker.kernels.kv_write import write_kv


def _fused_qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, generator):
    """k and v as the model has them: strided slices of one [T, (H + 2 * KVH) * D] projection."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(dtype).to(DEVICE)
    kv = qkv[:, num_heads * head_dim :].view(num_tokens, 2 * num_kv_heads, head_dim)
    return kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # each [T, KVH, D], row stride (H + 2 * KVH) * D


def _reference(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    keep = slot_mapping >= 0
    expected = cache.clone()
    expected.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping[keep], new[keep])
    return expected


@pytest.mark.parametrize(
    "dtype, block_size, num_kv_heads, head_dim",
    [
        (torch.float32, 16, 2, 32),
        (torch.float16, 32, 3, 24),  # neither KVH nor D a power of two
        (torch.bfloat16, 16, 1, 64),
    ],
)
def test_writes_each_token_to_its_slot_and_skips_padding(dtype, block_size, num_kv_heads, head_dim):
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 19
    key, value = _fused_qkv_views(num_tokens, 4 * num_kv_heads, num_kv_heads, head_dim, dtype, generator)
    assert not key.is_contiguous()
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype).to(DEVICE)
    value_cache = torch.randn(key_cache.shape, generator=generator).to(dtype).to(DEVICE)
    # distinct slots scattered over every page, in no order, with three padding tokens (-1)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slot_mapping[[2, 9, 18]] = -1
    expected_keys, expected_values = _reference(key_cache, key, slot_mapping), _reference(value_cache, value, slot_mapping)

    write_kv(key, value, key_cache, value_cache, slot_mapping)

    # a copy: exact, whatever the dtype
    assert torch.equal(key_cache, expected_keys)
    assert torch.equal(value_cache, expected_values)


def test_int32_slots_and_a_cache_view_of_the_layered_storage():
    # the worker's caches are per-layer views of one [2, layers, N, block_size, KVH, D] tensor
    generator = torch.Generator().manual_seed(1)
    storage = torch.zeros(2, 3, 4, 16, 2, 32, device=DEVICE)
    key_cache, value_cache = storage[0, 1], storage[1, 1]
    key = torch.randn(5, 2, 32, generator=generator).to(DEVICE)
    value = torch.randn(5, 2, 32, generator=generator).to(DEVICE)
    slot_mapping = torch.tensor([63, 0, 17, 40, 16], dtype=torch.int32, device=DEVICE)

    write_kv(key, value, key_cache, value_cache, slot_mapping)

    assert_close(key_cache.view(-1, 2, 32)[slot_mapping.long()], key, torch.float32)
    assert_close(value_cache.view(-1, 2, 32)[slot_mapping.long()], value, torch.float32)
    assert storage.count_nonzero() == 2 * 5 * 2 * 32  # no other layer or slot touched


def _valid_args():
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.float16, device=DEVICE)
    return dict(
        key=torch.zeros(3, 2, 32, dtype=torch.float16, device=DEVICE),
        value=torch.zeros(3, 2, 32, dtype=torch.float16, device=DEVICE),
        key_cache=cache,
        value_cache=cache.clone(),
        slot_mapping=torch.tensor([0, 5, 9], device=DEVICE),
    )


@pytest.mark.parametrize(
    "name, make_bad, message",
    [
        ("key", lambda args: args["key"].float(), r"key has dtype torch.float32, expected torch.float16 \(key_cache's"),
        ("value", lambda args: args["value"][:, :1], r"value has shape \[3, 1, 32\], expected \[3, 2, 32\]"),
        ("slot_mapping", lambda args: args["slot_mapping"].float(), r"slot_mapping has dtype torch.float32"),
        ("slot_mapping", lambda args: args["slot_mapping"][:2], r"slot_mapping has shape \[2\], expected \[3\]"),
        ("key_cache", lambda args: torch.zeros(4, 12, 2, 32, dtype=torch.float16, device=DEVICE), r"block_size 12"),
    ],
)
def test_rejects_bad_arguments(name, make_bad, message):
    args = _valid_args()
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=message):
        write_kv(**args)
