"""Plain HTTP for tests: a GET that must answer 200 with JSON. (Not named ``http``: the
registry child script runs with tests/helpers first on its path, where that name would shadow
the standard library's ``http`` for everything it imports.)"""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return json.loads(response.read())
