"""Check your own port: a researcher's PyTorch model against its Flax translation (docs/porting.md).

    report = jaxloop.parity.compare(torch_module, flax_module, batch, torch_loss, flax_loss)
    print(report); report.assert_ok()

or `python -m jaxloop.parity PATH.py:FACTORY`. torch is imported only when a check runs: importing
this package needs jax and Flax alone.
"""

from jaxloop.parity.compare import check, compare, map_weights
from jaxloop.parity.errors import ModelError
from jaxloop.parity.port import Port, flax_output_loss, torch_output_loss
from jaxloop.parity.port_report import Report, Row
from jaxloop.parity.torchside import TorchMissing
from jaxloop.parity.transfer import flax_leaves, flax_variables, load_into_torch
from jaxloop.parity.weights import LAYOUTS, Mapping, MappingError

__all__ = [
    "LAYOUTS",
    "Mapping",
    "MappingError",
    "ModelError",
    "Port",
    "Report",
    "Row",
    "TorchMissing",
    "check",
    "compare",
    "flax_leaves",
    "flax_output_loss",
    "flax_variables",
    "load_into_torch",
    "map_weights",
    "torch_output_loss",
]
