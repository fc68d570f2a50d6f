"""tests/typecheck/public_api.py, where pyright (.ci/run) checks that each public name of jaxloop resolves to
what it names, lists every one of them: a name added to jaxloop's TYPE_CHECKING block is checked too."""

from __future__ import annotations

import re
from pathlib import Path

import jaxloop


def test_the_typing_check_lists_every_public_name():
    source = (Path(__file__).parent / "typecheck" / "public_api.py").read_text(encoding="utf-8")
    checked = set(re.findall(r"_resolved\(jaxloop\.(\w+)\)", source))
    # jaxloop.parity (the port check, which needs torch) is public but left out of __all__ (`import *`)
    assert checked == {*jaxloop.__all__, "parity"}
