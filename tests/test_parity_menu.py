"""Every registered optimizer and schedule (jaxloop.config.optimizers.OPTIMIZERS, schedules_config.SCHEDULES)
has a parity case in parity_tests/menu.py (run against torch by parity_tests/test_optimizers.py and
test_schedules.py) and a builder in each framework's table: a class registered without them fails here."""

from __future__ import annotations

import pytest

from jaxloop import OptimConfig
from jaxloop.config.optimizers import OPTIMIZERS
from jaxloop.config.schedules import SCHEDULES


def test_every_registered_optimizer_and_schedule_has_a_parity_case():
    # mutant seen failing: a DummyConfig(OptimizerConfig) added to OPTIMIZERS with no case in the menu
    from parity_tests import menu

    assert {OptimConfig(**c).name for c in menu.OPTIMIZERS.values()} == set(OPTIMIZERS)
    assert {OptimConfig(**c).schedule for c in [*menu.SCHEDULES.values(), menu.PLATEAU]} == set(SCHEDULES)


@pytest.mark.torch  # torch_ref's table is built of torch.optim classes
def test_every_registered_optimizer_has_a_builder_in_jaxloop_and_torch_ref():
    # each framework builds from its own table (the config layer imports neither)
    # mutant seen failing: LionConfig's row taken out of torch_ref.optim.TORCH_OPTIMIZERS
    from jaxloop.update.transforms import BUILDERS
    from torch_ref.optim import TORCH_OPTIMIZERS
    from torch_ref.schedule import TORCH_AFTER_WARMUP

    assert set(BUILDERS) == set(TORCH_OPTIMIZERS) == set(OPTIMIZERS.values())
    own = {"warmup_cosine", "one_cycle", "plateau"}  # torch_ref.make_scheduler builds these whole, no warmup chain
    assert {c.name for c in TORCH_AFTER_WARMUP} | own == set(SCHEDULES)
    assert not {c.name for c in TORCH_AFTER_WARMUP} & own
