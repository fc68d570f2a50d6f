"""What pyproject.toml's pins promise of the environment pip installs from it."""

from __future__ import annotations

from importlib.metadata import version


def _major_minor(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def test_ml_dtypes_is_below_0_7_wherever_numpy_is_below_2_5():
    # ml_dtypes 0.7.0's import registers its ufunc loops through numpy's PyUFunc_AddLoop, which before numpy 2.5
    # scans every loop already registered: 0.5 s of CPU in every process that imports jax (docs/speed.md,
    # "Start-up"). pip's numpy on Python 3.11 is 2.4 (2.5 needs 3.12), so pyproject.toml keeps ml_dtypes below
    # 0.7 there, and asks for numpy 2.5 or newer on 3.12 and later, where any ml_dtypes jax accepts is quick.
    # mutant seen failing: the pin removed from pyproject.toml and the environment reinstalled (ml_dtypes 0.7.0)
    numpy, ml_dtypes = version("numpy"), version("ml_dtypes")
    assert _major_minor(numpy) >= (2, 5) or _major_minor(ml_dtypes) < (0, 7), (numpy, ml_dtypes)
