"""bench/quintic_maps.py: its derivation reproduces the re-derived map sets stored in train_gpt.py's
ORTHOGONALIZERS (to 1e-12: float64, deterministic), and each map is the minimax one: |p - 1|
equioscillates at four points of its design interval."""
import importlib.util
import os

import numpy as np
import pytest
from helpers import ROOT

import train_gpt as T

SCRIPT = os.path.join(ROOT, "bench", "quintic_maps.py")
SPEC = importlib.util.spec_from_file_location("quintic_maps", SCRIPT)
Q = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(Q)


@pytest.mark.parametrize("name", Q.DESIGNS)
def test_derivation_reproduces_the_stored_map_sets(name):
    num_maps, floor = Q.DESIGNS[name]
    coeffs, safety, _ = T.ORTHOGONALIZERS[name]
    assert safety == Q.SAFETY
    np.testing.assert_allclose(Q.derive_maps(num_maps, floor), coeffs, rtol=1e-12, atol=0)


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
