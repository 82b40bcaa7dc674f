"""``GET /metrics`` text: our families out of every node's Ray export, merged into one valid
exposition, with each histogram of the table present from the first scrape.

Ray exports a histogram only once something was observed, so a fresh server's latency
panels would show "no data" and ``rate()`` of their counts would be absent, not 0.
Every histogram the table defines for a model is filled in at zero (each bucket, the
count and the sum) for each served model until its real series exists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from serve_app.metrics.table import EXPORT_PREFIX, HISTOGRAM_SERIES, METRICS, MetricDef

# Ray's own labels on every sample: renamed to Prometheus' snake_case, or dropped
# where they say nothing a series needs (process kind, versions, empty OTel scope).
RAY_LABELS = {"NodeAddress": "node", "WorkerId": "worker_id"}
RAY_LABELS_DROPPED = {"Component", "SessionName", "Version", "otel_scope_name",
                      "otel_scope_schema_url", "otel_scope_version"}


def merge_exposition(texts: Iterable[str], models: Iterable[str] = (),
                     prefix: str = EXPORT_PREFIX + "serve_app_") -> str:
    """Our metric families out of several nodes' exports, as one valid exposition.

    Each node's text has every family once; two nodes' texts repeat family
    headers, which Prometheus rejects, so samples are regrouped under one.
    Ray's CamelCase labels become snake_case (``promtool check metrics``). Each table
    histogram of each of ``models`` not observed yet is filled in at zero.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    for text in texts:
        ours = "\n".join(line for line in text.splitlines()
                         if line.startswith(prefix) or line.startswith(("# HELP " + prefix,
                                                                          "# TYPE " + prefix)))
        for family in text_string_to_metric_families(ours + "\n"):
            family.samples = [_relabel(s) for s in family.samples]
            if family.name in families:
                families[family.name].samples.extend(family.samples)
            else:
                families[family.name] = family
    for d in METRICS:
        if d.kind == "histogram" and "model" in d.labels:
            _fill_at_zero(families, d, models)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry).decode()


def _relabel(sample: Any) -> Any:
    labels = {RAY_LABELS.get(k, k): v for k, v in sample.labels.items()
              if k not in RAY_LABELS_DROPPED}
    return sample._replace(labels=labels)


class _Families:
    def __init__(self, families: Iterable[Any]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Any]:
        return self._families


def _fill_at_zero(families: dict[str, Any], d: MetricDef, models: Iterable[str]) -> None:
    """Zero buckets, count and sum for each series of ``d`` (each model, each label set
    of ``HISTOGRAM_SERIES``) that no node exported yet."""
    name = EXPORT_PREFIX + d.name
    family = families.get(name)
    seen = set() if family is None else {
        tuple(s.labels.get(k, "") for k in d.labels) for s in family.samples}
    missing = []
    for model in models:
        for extra in HISTOGRAM_SERIES.get(d.name, ({},)):
            labels = {"model": model, **extra}
            if tuple(labels.get(k, "") for k in d.labels) not in seen:
                missing.append(labels)
    if not missing:
        return
    if family is None:
        family = families[name] = Metric(name, d.help, "histogram")
    for labels in missing:
        for bound in (*d.buckets, float("inf")):
            family.samples.append(Sample(f"{name}_bucket",
                                         {**labels, "le": floatToGoString(bound)}, 0.0))
        family.samples.append(Sample(f"{name}_count", labels, 0.0))
        family.samples.append(Sample(f"{name}_sum", labels, 0.0))
