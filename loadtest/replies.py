"""Reading the models' replies (no Locust here: importing Locust monkey-patches the process)."""

import json


def parse_json_object(text: str) -> dict | None:
    """The first JSON object in a reply (models wrap it in prose or code fences), or None."""
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
            if isinstance(value, dict):
                return value
        except json.JSONDecodeError:
            pass
        start = text.find("{", start + 1)
    return None
