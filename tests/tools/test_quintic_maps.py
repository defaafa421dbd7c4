"""bench/quintic_maps.py: its derivation reproduces the re-derived map sets it stores in MAP_SETS (to 1e-12:
float64, deterministic), each map is the minimax one (|p - 1| equioscillates at four points of its design
interval), and its sets run through train_gpt's orthogonalization as their `coeffs`."""
import importlib.util
import os

import numpy as np
import pytest
import torch
from helpers import ROOT

import train_gpt as T

SCRIPT = os.path.join(ROOT, "bench", "quintic_maps.py")
SPEC = importlib.util.spec_from_file_location("quintic_maps", SCRIPT)
Q = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(Q)


@pytest.mark.parametrize("name", Q.DESIGNS)
def test_derivation_reproduces_the_stored_map_sets(name):
    num_maps, floor = Q.DESIGNS[name]
    coeffs, safety, eps = Q.MAP_SETS[name]
    assert len(coeffs) == num_maps and safety == Q.SAFETY == T.POLAR_SAFETY and eps == T.POLAR_EPS
    np.testing.assert_allclose(Q.derive_maps(num_maps, floor), coeffs, rtol=1e-12, atol=0)


def test_the_sets_are_train_gpts_polar_express_and_the_ones_its_removed_setting_names():
    """MAP_SETS starts with the maps and normalization train_gpt.py runs; the other names are those the removed
    ORTHOGONALIZER setting took, whose error sends the reader here."""
    assert Q.MAP_SETS["polar_express"] == (T.POLAR_EXPRESS_COEFFS, T.POLAR_SAFETY, T.POLAR_EPS)
    assert list(Q.MAP_SETS) == ["polar_express", "newton_schulz", "polar_express5_l3e3", "polar_express6_l3e4"]
    assert Q.MAP_SETS["newton_schulz"] == (((3.4445, -4.7750, 2.0315),) * 5, 1.0, 1e-7)
    with pytest.raises(T.SetupError, match=r"^ORTHOGONALIZER was removed: .*bench/quintic_maps\.py keeps the others"):
        T.Hyperparameters.from_env({"ORTHOGONALIZER": "newton_schulz"})


@pytest.mark.parametrize("name", ["polar_express", "newton_schulz", "polar_express6_l3e4"])
def test_a_set_runs_through_train_gpts_functions_with_its_own_maps_and_normalization(name):
    """Q.orthogonalize is train_gpt's bf16 iteration on the set's normalization and maps (polar_express: its
    orthogonalize itself, bit for bit); Q.orthogonalize_float64 its float64 function with the set's values."""
    coeffs, safety, eps = Q.MAP_SETS[name]
    G = torch.randn(2, 24, 40)
    expected = T.polar_iterations_reference(T.polar_normalize(G, safety, eps), coeffs)
    assert torch.equal(Q.orthogonalize(G, name), expected)
    if name == "polar_express":
        assert torch.equal(Q.orthogonalize(G, name), T.orthogonalize(G))
    X = G.double() / (G.double().norm(dim=(-2, -1), keepdim=True) * safety + eps)
    for a, b, c in coeffs:  # wide matrices: X·Xᵀ
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    torch.testing.assert_close(Q.orthogonalize_float64(G, name), X, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("low, high", [(1e-3 / 1.02, 1.0), (0.1, 1.5), (0.8, 1.2)])
def test_each_map_is_the_minimax_quintic_of_its_interval(low, high):
    coeffs, error = Q.optimal_odd_quintic(low, high)
    sigma = np.geomspace(low, high, 100_001)
    deviation = Q.composed_map([coeffs], sigma) - 1
    assert abs(np.abs(deviation).max() - error) < 1e-9 * error
    # four alternating extrema of size E: low (-E), an interior max (+E), an interior min (-E), high (+E)
    assert deviation[0] == pytest.approx(-error) and deviation[-1] == pytest.approx(error)
    turns = np.flatnonzero(np.diff(np.sign(np.diff(deviation)))) + 1
    assert len(turns) == 2 and deviation[turns] == pytest.approx([error, -error], rel=1e-6)
