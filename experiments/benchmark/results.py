"""The benchmark's results: a JSON file rewritten after every measurement.

`Results` holds one nested dictionary and writes it atomically (a
temporary file in the same folder, then ``os.replace``) each time a
measurement lands, so a run cut short still leaves everything it finished.
"""

from __future__ import annotations

import json
import os
from typing import Any

from experiments.results import write_text_atomically


class Results:
    """Nested results, persisted to ``<out_dir>/results.json`` on every change."""

    def __init__(self, out_dir: str, header: dict[str, Any]):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, "results.json")
        self.data: dict[str, Any] = dict(header)
        os.makedirs(out_dir, exist_ok=True)
        self.write()

    def put(self, keys: tuple[str, ...], value: Any) -> None:
        """Sets ``data[k0][k1]...[kn] = value`` and rewrites the file."""
        node = self.data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        self.write()

    def get(self, keys: tuple[str, ...]) -> Any:
        """``data[k0][k1]...[kn]``, or None where any key is missing."""
        node: Any = self.data
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    def write(self) -> None:
        write_text_atomically(self.path, json.dumps(self.data, indent=2, sort_keys=False) + "\n")
