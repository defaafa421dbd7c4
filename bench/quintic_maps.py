"""The odd quintic maps of the orthogonalization (docs/TECHNIQUES.md T2.3) on the CPU: each set's
envelope in float64, the singular values our bank updates bring to them, the derivation of the
re-derived sets, and (--bf16) what bf16 rounding does to them. train_gpt.py runs Polar Express's maps
alone; the other sets measured in training (Newton-Schulz, the re-derived ones) live here, in MAP_SETS,
and run through train_gpt's functions as their `coeffs` (bench/bench_orthogonalize.py --method times them).

    python bench/quintic_maps.py                 # envelopes, spectra, derivation (seconds)
    python bench/quintic_maps.py --derive        # the derivation alone: the coefficient tuples (MAP_SETS')
    python bench/quintic_maps.py --bf16 [--top-slack 0] [--cushion 0]
                                                 # the sets through the bf16 path (a minute), derived
                                                 # as given: without the slack or the cushion

A set of maps p_t(σ) = a·σ + b·σ³ + c·σ⁵ acts on every singular value of X = G / (safety·‖G‖_F + eps)
independently, so the composed scalar map says everything about the iteration in exact arithmetic.
Its envelope over [ℓ, 1] is the (min, max) of the composed map over a dense log grid of σ ∈ [ℓ, 1];
'scaled', each σ divided by the safety factor first: then σ is σ_i(G)/‖G‖_F, the update's own
singular value as a share of its norm, and ℓ a floor on those shares (the number that matters).

The derivation (the greedy construction of Polar Express, Amsel et al. 2025, written here from its
description): step t maps the interval [ℓ_t, u_t] its input can occupy with the odd quintic closest
to 1 in the max norm (Remez exchange on four alternation points: the ends and the two interior
extrema, the roots of p' = a + 3bσ² + 5cσ⁴), and the next interval is that map's image. ℓ_0 =
ℓ/safety for a floor ℓ on σ_i(G)/‖G‖_F, u_0 = 1: the input is at most 1/safety, so bf16 rounding of X
stays inside. Two guards against bf16 rounding, both needed (--bf16 with either set to 0):
- top slack: from the second map on, the design interval reaches TOP_SLACK above the previous map's
  maximum (2^-8 relative per bf16 rounding, TOP_SLACK covers two), because above its design interval
  a quintic with c > 0 grows fast: without it (--top-slack 0) the six-map sets sent singular values
  to 807 and 3.3e5 in bf16;
- cushion: the design interval starts at no less than CUSHION x its top. The exact minimax map
  equioscillates, so mid-sized inputs land on the next interval's floor (the exact first map for
  [1e-3, 1] sends σ ≈ 0.6 to 0.0085), where bf16's absolute rounding error is a large relative one;
  with the cushion those values land higher, and only inputs near the floor reach the bottom. Without
  it (--cushion 0) six maps from 3e-4 dipped to 0.56 in bf16 against an envelope of 0.92, and the
  tight sets to 0.980 (0.990 and 0.995 with it). CUSHION 0.02 was the best of 0.01-0.05 on that path.
"""
import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T

TOP_SLACK = 2.0 ** -7
CUSHION = 0.02
SAFETY = T.POLAR_SAFETY  # the normalization's safety factor, as for polar_express (1.02)
# name in MAP_SETS: (number of maps, floor ℓ on σ_i(G)/‖G‖_F)
DESIGNS = {"polar_express5_l3e3": (5, 3e-3), "polar_express6_l3e4": (6, 3e-4)}

# Classic Muon Newton-Schulz quintic (#3): singular values land in about [0.68, 1.13].
NEWTON_SCHULZ_COEFFS = ((3.4445, -4.7750, 2.0315),) * 5
# The greedy construction's sets (DESIGNS; derive_maps reproduces them, tests/tools/test_quintic_maps.py):
# exact-arithmetic envelopes for σ_i(G)/‖G‖_F in [ℓ, 1] (polar_express: [0.8467, 1.1411] from 1e-3):
# five maps from 3e-3: [0.9931, 1.0069]; six from 3e-4: [0.9121, 1.0879]. (Six from 1e-3, [0.9984, 1.0016],
# gave main's loss at a sixth more work; four from 1e-2 cost more loss than the time they save.)
GREEDY5_FLOOR_3E3_COEFFS = (
    (7.710969245867679, -22.113754790481156, 16.24874301773847),
    (4.144837788446324, -3.434457866214604, 0.7291428289304236),
    (3.6219906611071337, -2.841498004519581, 0.5932121716542422),
    (2.520263341903864, -1.837610522467476, 0.4271193069501146),
    (1.9194472142571712, -1.2898333752956908, 0.3719505132726187),
)
GREEDY6_FLOOR_3E4_COEFFS = (
    (7.710969245867679, -22.113754790481156, 16.24874301773847),
    (4.144837788446324, -3.434457866214604, 0.7291428289304236),
    (4.144837788446322, -3.4344578662146046, 0.7291428289304237),
    (4.12645868223001, -3.413555682612789, 0.7243452639561597),
    (3.1657177848996447, -2.340118382992727, 0.4814640317675152),
    (2.1907616171925604, -1.5529037214894479, 0.39749933657357994),
)
MAP_SETS = {  # name: (coefficients, the normalization's safety factor, its epsilon); the first: train_gpt's own
    "polar_express": (T.POLAR_EXPRESS_COEFFS, T.POLAR_SAFETY, T.POLAR_EPS),
    "newton_schulz": (NEWTON_SCHULZ_COEFFS, 1.0, 1e-7),
    "polar_express5_l3e3": (GREEDY5_FLOOR_3E3_COEFFS, SAFETY, T.POLAR_EPS),
    "polar_express6_l3e4": (GREEDY6_FLOOR_3E4_COEFFS, SAFETY, T.POLAR_EPS),
}
FLOORS = (3e-4, 1e-3, 3e-3, 1e-2)
# (rows, cols) of one matrix of each bank: qk, narrow qk (T3.18), vo, mlp (up and projection alike)
BANK_SHAPES = {"qk": (256, 768), "qk narrow": (128, 768), "vo": (768, 768), "mlp": (3072, 768)}


def orthogonalize(G: torch.Tensor, name: str, use_triton: bool | None = None) -> torch.Tensor:
    """train_gpt's bf16 orthogonalization of the bank G with set `name`'s maps: T.orthogonalize itself where the
    set normalizes as Polar Express does; its two stages with the set's own normalization otherwise
    (newton_schulz: ‖G‖_F, no safety factor)."""
    coeffs, safety, eps = MAP_SETS[name]
    if (safety, eps) == (T.POLAR_SAFETY, T.POLAR_EPS):
        return T.orthogonalize(G, use_triton, coeffs)
    return T.polar_iterations(T.polar_normalize(G, safety, eps), use_triton, coeffs)


def orthogonalize_float64(G: torch.Tensor, name: str) -> torch.Tensor:
    """The float64 iteration of set `name` (T.orthogonalize_float64 with its maps and normalization)."""
    coeffs, safety, eps = MAP_SETS[name]
    return T.orthogonalize_float64(G, coeffs, safety, eps)


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


def derive_maps(num_maps: int, floor: float, safety: float = SAFETY, top_slack: float = TOP_SLACK,
                cushion: float = CUSHION):
    """The greedy set of num_maps odd quintics for σ_i(G)/‖G‖_F in [floor, 1] (module docstring)."""
    low, high, maps = floor / safety, 1.0, []
    for step in range(num_maps):
        top = high * (1 + top_slack) if step else high
        coeffs, error = optimal_odd_quintic(max(low, cushion * top), top)
        maps.append(coeffs)
        # below the cushioned design interval the map still rises: its floor is the image of low
        low, high = min(float(composed_map([coeffs], low)), 1 - error), 1 + error
    return tuple(maps)


def report_envelopes():
    print("envelope (min, max) of the composed map over σ in [ℓ, 1]; 'scaled': σ/safety, what the normalization feeds")
    for name, (coeffs, safety, _) in MAP_SETS.items():
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


def report_derivation(top_slack: float = TOP_SLACK, cushion: float = CUSHION, code: bool = True):
    print(f"greedy minimax maps: safety {SAFETY}, top slack {top_slack}, cushion {cushion}; "
          "envelope (scaled) for σ_i(G)/‖G‖_F in [ℓ, 1]")
    derived = {}
    for name, (num_maps, floor) in DESIGNS.items():
        derived[name] = maps = derive_maps(num_maps, floor, top_slack=top_slack, cushion=cushion)
        bands = "  ".join(f"ℓ={other:.0e}: [{low:.5f}, {high:.5f}]" for other in FLOORS
                          for low, high in [envelope(maps, other, input_scale=1 / SAFETY)])
        print(f"{name} ({num_maps} maps, floor {floor:.0e}): {bands}")
        if code:
            print("(\n" + "".join(f"    ({a!r}, {b!r}, {c!r}),\n" for a, b, c in maps) + ")")
    return derived


def report_bf16(sets: dict, trials: int = 60, seed: int = 0):
    """Each set (name: maps, normalized as Polar Express) through T.orthogonalize's bf16 path (on the CPU: fp32
    products rounded to bf16 where the GPU's bf16 GEMMs round): the least and largest output singular value over matrices with singular
    values uniform in [0.1, 1] (shares of the norm about 0.02-0.2, all inside every floor), and the
    largest over Gaussian matrices with a rank-one spike (a share near 1: the top of the interval)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 64, 64), (3, 48, 160), (3, 160, 48)]
    print(f"bf16 path, {trials} trials per set: [least, largest] singular value; largest with a spike")
    for name, maps in sets.items():
        low, high, spiked = 9.0, 0.0, 0.0
        for trial in range(trials):
            batch, rows, cols = shapes[trial % 3]
            k = min(rows, cols)
            U = torch.linalg.qr(torch.randn(batch, rows, k, generator=generator)).Q
            V = torch.linalg.qr(torch.randn(batch, cols, k, generator=generator)).Q
            s = torch.empty(batch, k).uniform_(0.1, 1.0, generator=generator)
            sv = torch.linalg.svdvals(T.orthogonalize(U @ torch.diag_embed(s) @ V.mT, coeffs=maps).double())
            low, high = min(low, sv.min().item()), max(high, sv.max().item())
            spike = 30 * torch.randn(batch, rows, 1, generator=generator) @ torch.randn(batch, 1, cols, generator=generator)
            G = torch.randn(batch, rows, cols, generator=generator) + spike / k ** 0.5
            spiked = max(spiked, torch.linalg.svdvals(T.orthogonalize(G, coeffs=maps).double()).max().item())
        print(f"{name:>20}: [{low:.4f}, {high:.4f}]  spiked {spiked:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--derive", action="store_true", help="only the derivation and its coefficient tuples")
    parser.add_argument("--bf16", action="store_true", help="the derived sets and today's through the bf16 path")
    parser.add_argument("--top-slack", type=float, default=TOP_SLACK, help=f"derive with this top slack [{TOP_SLACK}]")
    parser.add_argument("--cushion", type=float, default=CUSHION, help=f"derive with this cushion [{CUSHION}]")
    args = parser.parse_args()
    if not (args.derive or args.bf16):
        report_envelopes()
        report_spectra()
    derived = report_derivation(args.top_slack, args.cushion, code=not args.bf16)
    if args.bf16:
        report_bf16({"polar_express": T.POLAR_EXPRESS_COEFFS, **derived})
