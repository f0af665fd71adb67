"""The float64 references against hand-computable cases (they are what every kernel test trusts)."""

import math

import pytest
import torch
from kvkernels.reference import attention_reference, gather_paged, paged_decode_reference, row_errors, value_spread


def test_equal_scores_average_the_values() -> None:
    q = torch.zeros(1, 1, 3, 8)
    v = torch.randn(1, 1, 5, 8)
    out = attention_reference(q, torch.randn(1, 1, 5, 8), v)
    torch.testing.assert_close(out[0, 0], v[0, 0].double().mean(0).expand(3, 8))


def test_causal_first_query_sees_only_the_first_key() -> None:
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0].double())


def test_causal_mask_aligns_to_the_bottom_right() -> None:
    # Two queries at the end of six keys: the last query sees all keys, the first all but the last.
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    out = attention_reference(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, 1], attention_reference(q[:, :, 1:], k, v)[:, :, 0])
    torch.testing.assert_close(out[:, :, 0], attention_reference(q[:, :, :1], k[:, :, :5], v[:, :, :5])[:, :, 0])


def test_gqa_equals_repeated_heads() -> None:
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    grouped = attention_reference(q, k, v)
    repeated = attention_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(grouped, repeated)


def test_scales_dequantise_and_softmax_scale_applies() -> None:
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    scaled = attention_reference(q, k, v, q_scale=2.0, k_scale=0.5, v_scale=3.0, softmax_scale=0.25)
    manual = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 0.25, -1) @ (3.0 * v.double())
    torch.testing.assert_close(scaled, manual)


def test_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_reference(torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="at most as many queries"):
        attention_reference(torch.randn(1, 1, 5, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), causal=True)


def test_gather_paged_follows_the_block_table() -> None:
    cache = torch.arange(4 * 2 * 1 * 1, dtype=torch.float32).view(4, 2, 1, 1)  # 4 pages of 2 tokens
    tokens = gather_paged(cache, torch.tensor([3, 0, 2]), seq_len=5)
    assert tokens.flatten().tolist() == [6.0, 7.0, 0.0, 1.0, 4.0]


def test_paged_decode_reference_matches_contiguous_attention() -> None:
    k, v = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    cache_k = torch.zeros(4, 4, 2, 16)
    cache_v = torch.zeros(4, 4, 2, 16)
    table = torch.tensor([[2, 0]])
    for slot in range(7):
        page, offset = table[0, slot // 4], slot % 4
        cache_k[page, offset], cache_v[page, offset] = k[:, slot], v[:, slot]
    q = torch.randn(1, 4, 16)
    out = paged_decode_reference(q, cache_k, cache_v, table, torch.tensor([7]))
    expected = attention_reference(q[:, :, None], k[None], v[None])[:, :, 0]
    torch.testing.assert_close(out, expected)


def test_row_errors_measure_shrink_and_error() -> None:
    ref = torch.randn(10, 32).double()
    error, shrink = row_errors(ref * 0.9, ref)
    assert error == pytest.approx(0.1)
    assert shrink == pytest.approx(-0.1)
    assert math.isclose(row_errors(ref, ref)[0], 0.0, abs_tol=1e-15)


def test_value_spread_weights_value_norms_by_attention() -> None:
    # Two tokens, one query head: equal scores give Σw‖v‖/Σw = the mean norm; w = (1, 1), so max‖v‖/Σw = 4 / 2.
    keys = torch.zeros(2, 1, 1, 4)  # [blocks, page of 1 token, 1 KV head, head_dim 4]
    values = torch.tensor([[[[3.0, 0.0, 0.0, 0.0]]], [[[0.0, 4.0, 0.0, 0.0]]]])
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    spread, largest = value_spread(torch.ones(1, 1, 4), keys, values, table, torch.tensor([2]))
    torch.testing.assert_close(spread, torch.tensor([[3.5]], dtype=torch.float64))
    torch.testing.assert_close(largest, torch.tensor([[2.0]], dtype=torch.float64))
