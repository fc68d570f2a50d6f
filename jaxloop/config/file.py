"""A --config file (YAML or JSON) read into a dict of config fields, bounded: the file's size, and for YAML
the values its aliases expand to (a few hundred bytes of `&a [*b, *b, ...]` nest to billions), so that a
hostile or mistaken file is one line of bad input, at once. Imports no jax."""

from __future__ import annotations

import json
from typing import Any

import yaml

from jaxloop.config.errors import ConfigError

MAX_CHARS = 1 << 20
"""The longest --config file read (a run's config.json is ~2.5 KB)."""
MAX_VALUES = 100_000
"""The most values (mappings, lists, scalars) a YAML file may expand to, its aliases followed (a config has
a few hundred)."""


class TooManyValues(Exception):
    """A YAML document that expands to more than MAX_VALUES values."""


def expanded_size(node: yaml.Node, limit: int) -> int:
    """The values a composed YAML node stands for once every alias is followed (a shared node counts once per
    use), computed over the distinct nodes only; TooManyValues once beyond `limit`."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node) -> int:
        if id(n) not in sizes:
            if isinstance(n, yaml.MappingNode):
                children = [c for pair in n.value for c in pair]
            elif isinstance(n, yaml.SequenceNode):
                children = list(n.value)
            else:
                children = []
            total = 1 + sum(size(c) for c in children)
            if total > limit:
                raise TooManyValues
            sizes[id(n)] = total
        return sizes[id(n)]

    return size(node)


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a document expanding to more than MAX_VALUES values before it builds it."""

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        expanded_size(node, MAX_VALUES)
        return self.construct_document(node)


def read_config_file(path: str) -> dict[str, Any]:
    """The fields of a --config file; a ConfigError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_CHARS + 1)
    except OSError as e:
        raise ConfigError("--config", path, f"a readable YAML or JSON file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            "--config", path, f"a UTF-8 text file (byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8)"
        ) from None
    if len(text) > MAX_CHARS:
        raise ConfigError(
            "--config", path, f"a YAML or JSON file of at most {MAX_CHARS:,} characters (a config has a few thousand)"
        )
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.load(text, Loader=BoundedLoader)  # noqa: S506
    except TooManyValues:
        raise ConfigError(
            "--config",
            path,
            f"a YAML file of at most {MAX_VALUES:,} values once its aliases are "
            "followed (a config has a few hundred; these aliases expand beyond that)",
        ) from None
    except Exception as e:  # noqa: BLE001 - any parser error is bad input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mark = getattr(e, "problem_mark", None)  # YAML's: where the parser stopped (JSON's message says it)
        if mark is not None:
            first = f"line {mark.line + 1}, column {mark.column + 1}: {getattr(e, 'problem', None) or first}"
        raise ConfigError("--config", path, f"valid YAML or JSON ({first})") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "a mapping of config fields")
    for key, value in data.items():
        head, dot, rest = str(key).partition(".")
        if dot:  # a flag's dotted path written as a key: files nest sections
            raise ConfigError(
                str(key),
                value,
                f"in --config {path}, nest it under its section ({head}:, then "
                f"'  {rest}: {value}' on the next line): a file's keys are not dotted",
            )
    return data
