"""Prometheus /metrics pages as the tests read them, parsed by prometheus_client's own text parser.

The parser also checks the exposition format: a page Prometheus could not scrape fails the test that reads it.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str, timeout: float = 10) -> str:
    """The body of a /metrics page."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def samples(text: str) -> dict[str, list[Sample]]:
    """Sample name, as the page writes it (`x_total`, `x_bucket`, `x_count`, ...) -> its samples, in page order."""
    # The parser renames a counter declared without `_total` (Triton's own, e.g. nv_inference_count) to OpenMetrics'
    # `x_total`; Prometheus stores the name the page wrote, and dashboards query that, so it is given back here.
    bare_counters = set()
    for line in text.splitlines():
        parts = line.split()
        if parts[:2] == ["#", "TYPE"] and len(parts) == 4 and parts[3] == "counter" and not parts[2].endswith("_total"):
            bare_counters.add(parts[2])
    by_name: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        bare = family.type == "counter" and family.name in bare_counters
        for sample in family.samples:
            if bare:
                sample = sample._replace(name=sample.name.removesuffix("_total"))
            by_name.setdefault(sample.name, []).append(sample)
    return by_name


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, in a /metrics body (0 when absent).

    A registry outlives one test (the gateway's is process-wide; a stack serves a whole session), so tests compare
    a value before and after their own requests.
    """
    return sum(s.value for s in samples(text).get(name, ())
               if all(s.labels.get(key) == want for key, want in labels.items()))
