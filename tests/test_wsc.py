"""MAGIC WSC: hand-checkable rows, the XOR rule in each branch, untouched keys."""

import pytest
import torch

from mergecal.calibrations.wsc import Wsc, conservative, wsc_row_coefficients


def orthogonal_rows(K, n, seed=0, norms=None):
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
    norms = norms or [1.0] * K
    return [Q[:, k] * norms[k] for k in range(K)]


def test_average_of_orthogonal_task_rows_gets_sqrt_k():
    K = 4
    rows = orthogonal_rows(K, 10, norms=[1.0, 2.0, 0.5, 3.0])  # unequal norms: alpha_k = 1/K all the same
    taus = [r.view(1, -1) for r in rows]
    d = sum(taus) / K
    xi = wsc_row_coefficients(d, taus)
    torch.testing.assert_close(xi, torch.tensor([K**0.5]), rtol=1e-5, atol=1e-6)


def test_row_outside_the_task_span_is_scaled_to_the_mean_norm_sphere():
    rows = orthogonal_rows(3, 8, seed=1, norms=[1.0, 2.0, 3.0])
    d = orthogonal_rows(4, 8, seed=1)[3] * 5.0  # orthogonal to all three task rows, norm 5
    xi = wsc_row_coefficients(d.view(1, -1), [r.view(1, -1) for r in rows])
    torch.testing.assert_close(xi, torch.tensor([2.0 / 5.0]), rtol=1e-5, atol=1e-6)  # mean norm 2


def test_xi_is_per_row_and_scale_free():
    g = torch.Generator().manual_seed(2)
    taus = [torch.randn(5, 7, generator=g) for _ in range(3)]
    d = sum(taus) / 3
    xi = wsc_row_coefficients(d, taus)
    for row in range(5):
        single = wsc_row_coefficients(d[row:row + 1], [t[row:row + 1] for t in taus])
        torch.testing.assert_close(xi[row:row + 1], single)
    torch.testing.assert_close(wsc_row_coefficients(10 * d, taus) * 10, xi, rtol=1e-5, atol=1e-6)


def test_hand_computed_non_orthogonal_row():
    a1, a2, d = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])
    al1, al2 = 1.0 / (1 + 1e-8), 2.0 / (2 + 1e-8)
    perp = d - al1 * a1 - al2 * a2  # authors' (non-orthogonal) projection: [-1, 0, 1]
    mean = (1.0 + 2**0.5) / 2
    expected = 1 / (al1**2 + al2**2 + float(perp @ perp) / (mean**2 + 1e-8) + 1e-8) ** 0.5
    xi = wsc_row_coefficients(d.view(1, -1), [a1.view(1, -1), a2.view(1, -1)])
    torch.testing.assert_close(xi, torch.tensor([expected]), rtol=1e-6, atol=1e-7)
    # least squares: d = 0*a1 + 1*a2 + [0,0,1] -> alphas (0, 1), perp [0,0,1]
    expected_ls = 1 / (0 + 1 + 1 / (mean**2 + 1e-8) + 1e-8) ** 0.5
    xi_ls = wsc_row_coefficients(d.view(1, -1), [a1.view(1, -1), a2.view(1, -1)], projection="least_squares")
    torch.testing.assert_close(xi_ls, torch.tensor([expected_ls]), rtol=1e-5, atol=1e-6)


def test_conservative_xor_rule_in_each_branch():
    xi = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(conservative(xi, True), torch.tensor([0.5, 1.0, 1.0]))  # sensitive: shrink only
    torch.testing.assert_close(conservative(xi, False), torch.tensor([1.0, 1.0, 2.0]))  # others: grow only
    torch.testing.assert_close(conservative(xi, None), xi)  # no sensitive set: both ways


def test_calibrate_applies_rows_with_the_rule_and_leaves_other_keys_alone():
    g = torch.Generator().manual_seed(4)
    taus = [torch.randn(6, 5, generator=g) for _ in range(3)]
    merged = sum(taus) / 3  # averaging shrinks: most rows have xi > 1
    raw = wsc_row_coefficients(merged, taus)
    out_plain, _ = Wsc(sensitive=[]).calibrate("blk.mlp.c_fc.weight", merged, taus)
    torch.testing.assert_close(out_plain, merged * torch.where(raw > 1, raw, torch.ones_like(raw)).view(-1, 1))
    out_sens, info = Wsc(sensitive=["blk.mlp.c_fc.weight"]).calibrate("blk.mlp.c_fc.weight", merged, taus)
    torch.testing.assert_close(out_sens, merged * torch.where(raw < 1, raw, torch.ones_like(raw)).view(-1, 1))
    assert info["sensitive"] is True
    wsc = Wsc()
    assert wsc.covers("visual.conv1.weight", (8, 3, 2, 2), torch.float32)
    for key, shape in [("visual.proj", (8, 4)), ("text_projection", (8, 4)), ("visual.positional_embedding", (5, 8)),
                       ("visual.class_embedding", (8,)), ("ln_1.weight", (8,)), ("attn.in_proj_bias", (24,))]:
        assert not wsc.covers(key, shape, torch.float32), key


def test_conv_weights_are_calibrated_per_output_channel():
    g = torch.Generator().manual_seed(6)
    taus = [torch.randn(4, 3, 2, 2, generator=g) for _ in range(2)]
    merged = (taus[0] + taus[1]) / 2
    out, info = Wsc().calibrate("visual.conv1.weight", merged, taus)
    flat = wsc_row_coefficients(merged.reshape(4, -1), [t.reshape(4, -1) for t in taus])
    torch.testing.assert_close(out, merged * flat.view(4, 1, 1, 1))


def test_layer_granularity_is_one_xi_per_layer_as_in_algorithm_2():
    """granularity='layer' scales the whole merged matrix by the one xi of Eq. 22 over the flattened layer (an
    independent numpy computation); 'row' (the authors' code) gives each row its own and so a different result."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    taus = [torch.randn(4, 6, generator=g) * s for s in (1.0, 0.2)]
    merged = 0.3 * (taus[0] + taus[1])
    d, a = merged.double().numpy().ravel(), [t.double().numpy().ravel() for t in taus]
    alpha = [d @ ak / (ak @ ak + 1e-8) for ak in a]
    perp = d - sum(al * ak for al, ak in zip(alpha, a))
    mean_norm = np.mean([np.linalg.norm(ak) for ak in a])
    xi = 1 / np.sqrt(sum(al**2 for al in alpha) + perp @ perp / (mean_norm**2 + 1e-8) + 1e-8)
    layer, info = Wsc(granularity="layer").calibrate("w", merged, taus)
    assert info["xi"].shape == (1,) and float(info["xi"][0]) == pytest.approx(xi, rel=1e-6)
    assert torch.allclose(layer, merged * float(xi), rtol=1e-6)
    row, row_info = Wsc(granularity="row").calibrate("w", merged, taus)
    assert row_info["xi"].shape == (4,) and not torch.allclose(row, layer, rtol=1e-3)
    # the conservative rule acts on the one xi: a sensitive layer with xi > 1 is left alone
    assert xi > 1 and torch.equal(Wsc(granularity="layer", sensitive=["w"]).calibrate("w", merged, taus)[0], merged)
    assert "granularity='layer'" in Wsc(granularity="layer").id
