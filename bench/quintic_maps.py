"""The odd quintic maps of the orthogonalization (docs/TECHNIQUES.md T2.3), in float64 on the CPU (a few
seconds): each set's envelope, the singular values our bank updates bring to them, and the derivation
of the re-derived sets stored in train_gpt.py's ORTHOGONALIZERS.

    python bench/quintic_maps.py                 # all three reports
    python bench/quintic_maps.py --derive        # the derivation alone: the coefficient tuples to paste

A set of maps p_t(σ) = a·σ + b·σ³ + c·σ⁵ acts on every singular value of X = G / (safety·‖G‖_F + eps)
independently, so the composed scalar map says everything about the iteration in exact arithmetic.
Its envelope over [ℓ, 1] is the (min, max) of the composed map over a dense log grid of σ ∈ [ℓ, 1];
'scaled', each σ divided by the safety factor first: then σ is σ_i(G)/‖G‖_F, the update's own
singular value as a share of its norm, and ℓ a floor on those shares (the number that matters).

The derivation (the greedy construction of Polar Express, Amsel et al. 2025, written here from its
description): step t maps the interval [ℓ_t, u_t] its input can occupy with the odd quintic that is
closest to 1 in the max norm there (Remez exchange on four alternation points: ℓ_t, the two interior
extrema, which are the roots of p' = a + 3bσ² + 5cσ⁴, and u_t); its output lies in [1 - E_t, 1 + E_t],
the next interval. ℓ_0 = ℓ/safety for a floor ℓ on σ_i(G)/‖G‖_F, and u_0 = 1: the input is at most
1/safety, so bf16 rounding of X stays inside. From the second map on, the design
interval extends TOP_SLACK above 1 + E_t: bf16 rounding of the previous output (2^-8 relative per
rounding, TOP_SLACK covers two) cannot reach the region above the design interval, where a quintic
with c > 0 grows fast. The same set written the other way: every map aims a little below 1.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402

TOP_SLACK = 2.0 ** -7
SAFETY = 1.02  # the normalization's safety factor, as for polar_express
# name in ORTHOGONALIZERS: (number of maps, floor ℓ on σ_i(G)/‖G‖_F)
DESIGNS = {"polar_express5_l1e3": (5, 1e-3), "polar_express5_l3e3": (5, 3e-3), "polar_express6_l1e3": (6, 1e-3)}
FLOORS = (1e-3, 3e-3, 1e-2)
# (rows, cols) of one matrix of each bank: qk, narrow qk (T3.18), vo, mlp (up and projection alike)
BANK_SHAPES = {"qk": (256, 768), "qk narrow": (128, 768), "vo": (768, 768), "mlp": (3072, 768)}


def composed_map(coeffs, sigma):
    """The maps applied in turn to singular values sigma (float64 array)."""
    x = np.asarray(sigma, dtype=np.float64)
    for a, b, c in coeffs:
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
    return x


def envelope(coeffs, low: float, high: float = 1.0, input_scale: float = 1.0, points: int = 200_001):
    """(min, max) of the composed map over a log grid of σ in [low, high], each σ first multiplied by input_scale."""
    out = composed_map(coeffs, np.geomspace(low, high, points) * input_scale)
    return float(out.min()), float(out.max())


def optimal_odd_quintic(low: float, high: float, max_exchanges: int = 100):
    """((a, b, c), E): the odd quintic with the least max |p(σ) - 1| = E over [low, high] (Remez
    exchange; p - 1 alternates -E, +E, -E, +E at low, two interior extrema, high)."""
    points = np.array([low, low + 0.25 * (high - low), low + 0.75 * (high - low), high])
    signs = np.array([-1.0, 1.0, -1.0, 1.0])
    for _ in range(max_exchanges):
        system = np.stack([points, points ** 3, points ** 5, -signs], axis=1)
        a, b, c, error = np.linalg.solve(system, np.ones(4))
        roots = np.sort((-3 * b + np.array([-1.0, 1.0]) * np.sqrt(9 * b * b - 20 * a * c)) / (10 * c))
        exchanged = np.array([low, *np.sqrt(roots), high])
        if np.array_equal(exchanged, points):
            break
        points = exchanged
    return (float(a), float(b), float(c)), float(error)


def derive_maps(num_maps: int, floor: float, safety: float = SAFETY, top_slack: float = TOP_SLACK):
    """The greedy set of num_maps odd quintics for σ_i(G)/‖G‖_F in [floor, 1] (module docstring)."""
    low, high, maps = floor / safety, 1.0, []
    for step in range(num_maps):
        coeffs, error = optimal_odd_quintic(low, high * (1 + top_slack) if step else high)
        maps.append(coeffs)
        low, high = 1 - error, 1 + error
    return tuple(maps)


def report_envelopes():
    print("envelope (min, max) of the composed map over σ in [ℓ, 1]; 'scaled': σ/safety, what the normalization feeds")
    for name, (coeffs, safety, _) in T.ORTHOGONALIZERS.items():
        for floor in FLOORS:
            plain, scaled = envelope(coeffs, floor), envelope(coeffs, floor, input_scale=1 / safety)
            print(f"{name:>20} ({len(coeffs)} maps) ℓ={floor:.0e}: [{plain[0]:.5f}, {plain[1]:.5f}]  "
                  f"scaled [{scaled[0]:.5f}, {scaled[1]:.5f}]")


def report_spectra(seed: int = 0):
    """Singular values after the normalization: Gaussian matrices of each bank shape (the
    flattest spectrum an update can have, so the best case for σ_max), then spectra decaying as i^-α."""
    rng = np.random.default_rng(seed)
    print("normalized singular values σ_i / (1.02·‖G‖_F): max, median, 1 % quantile, min; share below each ℓ")
    for name, (rows, cols) in BANK_SHAPES.items():
        sv = np.linalg.svd(rng.standard_normal((rows, cols)), compute_uv=False)
        report_spectrum(f"{name} {rows}x{cols} Gaussian", sv / (SAFETY * np.linalg.norm(sv)))
    for alpha in (0.5, 1.0):
        for k in (128, 256, 768):
            sv = np.arange(1, k + 1) ** -alpha
            report_spectrum(f"k={k} σ_i ∝ i^-{alpha}", sv / (SAFETY * np.linalg.norm(sv)))


def report_spectrum(label: str, sv):
    below = "  ".join(f"<{floor:.0e}: {np.mean(sv < floor):6.2%}" for floor in FLOORS)
    print(f"{label:>28}: {sv.max():.4f} {np.median(sv):.4f} {np.quantile(sv, 0.01):.2e} {sv.min():.1e}  {below}")


def report_derivation():
    print(f"greedy minimax maps, safety {SAFETY}, top slack 2^-7; envelope (scaled) for σ_i(G)/‖G‖_F in [ℓ, 1]")
    for name, (num_maps, floor) in DESIGNS.items():
        maps = derive_maps(num_maps, floor)
        print(f"{name}: {num_maps} maps, floor ℓ={floor:.0e}")
        for other in FLOORS:
            low, high = envelope(maps, other, input_scale=1 / SAFETY)
            print(f"    ℓ={other:.0e}: [{low:.5f}, {high:.5f}]")
        print("(\n" + "".join(f"    ({a!r}, {b!r}, {c!r}),\n" for a, b, c in maps) + ")")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--derive", action="store_true", help="only the derivation and its coefficient tuples")
    args = parser.parse_args()
    if not args.derive:
        report_envelopes()
        report_spectra()
    report_derivation()
