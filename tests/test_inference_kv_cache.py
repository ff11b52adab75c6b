"""inference.kv_cache: the one-query attention that a compiled decode step uses in place of sdpa gives sdpa's
result (float32 rounding), with grouped-query heads and a padding mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinygpt.inference.kv_cache import one_query_attention


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_one_query_attention_is_sdpa(heads, kv_heads, masked):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(3, heads, 1, 16, generator=g)
    k, v = torch.randn(3, kv_heads, 9, 16, generator=g), torch.randn(3, kv_heads, 9, 16, generator=g)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 2, 5])[:, None])[:, None, None, :] if masked else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    got = one_query_attention(q, k, v, mask)
    assert got.shape == expected.shape == (3, heads, 1, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if masked:  # a padded key changes nothing: row 1 attends to its first 2 keys only
        v2 = v.clone()
        v2[1, :, 2:] = 1e6
        torch.testing.assert_close(one_query_attention(q, k, v2, mask)[1], got[1], rtol=0, atol=0)
