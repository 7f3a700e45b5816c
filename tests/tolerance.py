"""Elementwise error bounds scaled by a condition estimate of each element.

A bound of REL * max|ref| per array lets the small elements of an array be
wrong by far more than float32 rounding explains (under REL = 1e-4 an
element at 1e-3 of the maximum may be 10% off). Here every output element
gets its own scale:

    scale_i = max_k |ref_k,i - ref_i| + 2^-24 |ref_i|

ref: the float64 reference; ref_k (k < COPIES): the same reference run on
copies of every input and weight with each element multiplied by
(1 + 2^-24 z), z ~ N(0, 1) (a random relative change of about one float32
rounding): how far the exact result moves when its inputs move by their own
float32 rounding, i.e. the element's condition. Cancellation (a sum over
tokens or channels much smaller than its terms) gives a large scale; a small
but well-conditioned element keeps a small one. 2^-24 |ref_i|: the rounding
of the result itself. The check is, for every element,

    |ours_i - ref_i| <= C scale_i.

Structural zeros: an element with |ref_i| <= 2^-40 max|ref| is zero up to
float64 rounding (zero in exact arithmetic, e.g. Mamba-3's angle gradients
at L = 1, where q and k turn by the same angle, or a float32 underflow);
its float32 value is rounding noise that no input perturbation moves, so
its scale is one float32 ulp of the array's largest element, 2^-24 max|ref|.

Exact cancellation (sensitivity(..., cancels=True), named by the test with
its reason): where an exact invariance makes an element a near-exact
cancellation of terms as large as the array (Mamba-2 at L = 1: the gated
RMSNorm's scale invariance; Mamba-3 with dt ~ 20: rotation invariance of
q . k), input perturbations do not see the rounding of those terms, so
every element's scale gets 2^-24 max|ref| added. A 1% error in small
elements is then not caught there.

COPIES = 3: an element's estimate is small by chance when all its copies
nearly cancel (probability ~ (0.8 eps)^COPIES for eps of its typical
spread). Over the ~1.8e6 elements of the backward tests, COPIES = 2 left
single elements at ratio 80-350 (signs +-1 instead of N(0, 1): more), 3
keeps the worst within ~3x of the 99.99th percentile. The references run on
one torch thread (small ops; on a loaded 2-core machine two threads made
the Mamba-1 reference 4-6x slower), so the 3 extra runs cost about what
the thread contention did.

C = 128, from the measured worst |ours - ref| / scale over every backward
accuracy case (COPIES = 3): Mamba-1 31 (x_proj.weight, d = 64 L = 7 B = 3;
99.99th percentile 15, median 0.5), Mamba-2 60 (out_proj.weight, d = 32
L = 256 B = 3; 20, 0.6), Mamba-3 67 (in_proj.weight, d = 64 L = 64 B = 3;
22, 0.6): a margin of 1.9x over the single worst element and 6x over the
99.99th percentile. The Mamba-3 forward (tests/test_mamba3_forward.py, y
only) measures 51 at most. The negative controls multiply the smallest 20% of the
nonzero elements of an array by 1.01 (smallest_changed): in the controlled
cases the mutated worst ratio is at least 1151 (Mamba-1), 361 (Mamba-2,
D at d = 32 L = 530 B = 1, the case whose former bound allowed 1.85%) and
347 (Mamba-3, D), so every such 1% error fails.
"""
import contextlib
import sys

import numpy as np

ULP = 2.0 ** -24
ZERO = 2.0 ** -40  # |ref| <= ZERO max|ref|: a structural zero (above)
COPIES = 3
C = 128.0


class one_torch_thread(contextlib.ContextDecorator):
    """Run the torch references on one thread (context or decorator)."""

    def __enter__(self):
        torch = sys.modules.get("torch")
        self.before = torch.get_num_threads() if torch else None
        if torch:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.before is not None:
            sys.modules["torch"].set_num_threads(self.before)


def _perturb(a, rng):
    a = np.array(a, dtype=np.float64, copy=True)
    return a * (1.0 + ULP * rng.standard_normal(a.shape))


def sensitivity(reference, weights, arrays, *, keep=(), cancels=False, copies=COPIES,
                seed=0):
    """(ref, scale): ref = reference(weights, *arrays), a dict of float64
    arrays; scale: the per-element scale above, same keys and shapes.

    weights: dict of arrays; arrays: the other inputs (x, grad_output).
    keep: weight names left unperturbed (a value placed exactly on a clamp
    bound, where a perturbation would only measure the kink).
    cancels: the case has an exact invariance (see "Exact cancellation"
    above): every element's scale gets 2^-24 max|ref| of its array added.
    """
    rng = np.random.default_rng(seed)
    with one_torch_thread():
        ref = reference(weights, *arrays)
        spread = {k: np.zeros(np.shape(v)) for k, v in ref.items()}
        for _ in range(copies):
            w = {k: (np.array(v, dtype=np.float64) if k in keep else _perturb(v, rng))
                 for k, v in weights.items()}
            out = reference(w, *[_perturb(a, rng) for a in arrays])
            for k in spread:
                np.maximum(spread[k], np.abs(out[k] - ref[k]), out=spread[k])
    scale = {}
    for k, r in ref.items():
        top = float(np.abs(r).max()) if r.size else 0.0
        s = spread[k] + ULP * np.abs(r) + (ULP * top if cancels else 0.0)
        scale[k] = np.where(np.abs(r) <= ZERO * top, ULP * top, s)
    return ref, scale


def sensitivity_of_rows(reference, weights, x, g, lengths, names):
    """(ref, scale) of the weight gradients `names` of a ragged batch: each
    row alone at its length (x[i, :n], g[i, :n]) through `sensitivity`, the
    rows' refs and scales summed (a weight gradient is the rows' sum)."""
    ref = {k: 0.0 for k in names}
    scale = {k: 0.0 for k in names}
    for i, n in enumerate(lengths):
        r, s = sensitivity(reference, weights, (x[i:i + 1, :n], g[i:i + 1, :n]))
        for k in names:
            ref[k] = ref[k] + r[k]
            scale[k] = scale[k] + s[k]
    return ref, scale


def ratios(got, ref, scale):
    """|got - ref| / scale per element (0 where equal, inf where the scale
    is 0 and they differ)."""
    err = np.abs(np.asarray(got, dtype=np.float64).reshape(np.shape(ref)) - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(err == 0, 0.0, err / scale)


def worst_ratio(got, ref, scale):
    r = ratios(got, ref, scale)
    return float(r.max()) if r.size else 0.0


def assert_within(got, ref, scale, what, c=C):
    """|got - ref| <= c * scale elementwise; returns the worst ratio."""
    r = ratios(got, ref, scale)
    worst = float(r.max()) if r.size else 0.0
    if worst > c:
        i = np.unravel_index(int(np.argmax(r)), r.shape)
        got_i = np.asarray(got, dtype=np.float64).reshape(np.shape(ref))[i]
        raise AssertionError(f"{what}: |err| / scale = {worst:.3g} > {c} at {i} "
                             f"(got {got_i:.9g}, ref {ref[i]:.9g}, scale {scale[i]:.3g})")
    return worst


def assert_mixed_bound(got, ref, label, atol, rtol, worst):
    """The plain mixed bound |got - ref| <= atol + rtol |ref| elementwise
    (got widened to float64), not condition-scaled; records (max |err|,
    worst err / bound) as worst[label] and returns that ratio."""
    err = np.abs(np.asarray(got, dtype=np.float64) - ref)
    ratio = float((err / (atol + rtol * np.abs(ref))).max())
    worst[label] = (float(err.max()), ratio)
    assert ratio <= 1.0, f"{label}: max |err| {err.max():.3g}, worst err/bound {ratio:.3g}"
    return ratio


def report_all(*checks):
    """Generator for a module-scoped fixture: every GradientCheck's report
    of the worst ratios, printed at the end of the module."""
    yield
    for check in checks:
        for _ in check.report():  # (a generator: run it to its print)
            pass


def smallest_changed(a, frac=0.2, factor=1.01):
    """A float64 copy of a with the smallest frac of its nonzero elements (by
    magnitude) times factor: the mutation of the negative controls."""
    out = np.array(a, dtype=np.float64, copy=True)
    flat = out.reshape(-1)
    nz = np.flatnonzero(flat)  # a zero times factor would change nothing
    idx = nz[np.argsort(np.abs(flat[nz]), kind="stable")[:max(1, int(frac * nz.size))]]
    flat[idx] *= factor
    return out


class GradientCheck:
    """The elementwise check of a backward test file: every gradient array
    within C x scale, the worst ratio per array kept and printed at the end
    of the module (use `report` as a module-scoped autouse fixture)."""

    def __init__(self, names, title):
        self.names, self.title, self.worst = tuple(names), title, {}

    def compare(self, got, ref, scale, case, control=False):
        """assert_within for every array of got. control: the negative
        control, each array with the smallest 20% of its nonzero elements
        1% off must fail the same check."""
        import pytest
        assert set(got) == set(self.names)
        for name in self.names:
            ratio = assert_within(got[name], ref[name], scale[name], f"{case} {name}")
            if ratio > self.worst.get(name, (-1.0, ""))[0]:
                self.worst[name] = (ratio, case)
            if control:
                with pytest.raises(AssertionError):
                    assert_within(smallest_changed(got[name]), ref[name], scale[name],
                                  f"{case} {name} 1% off")

    def report(self):
        """Generator for a pytest fixture: prints the worst ratios at the end."""
        yield
        if self.worst:
            print(f"\nworst |err|/scale per array ({self.title}, bound {C}):")
            for name in self.names:
                if name in self.worst:
                    print(f"  {name:18s} {self.worst[name][0]:.3e}  ({self.worst[name][1]})")
