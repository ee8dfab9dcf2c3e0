"""docs/observability.md and the Grafana dashboard name exactly the metrics a shard serves."""

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from millpond import TableConfig
from millpond.service.server import ServerConfig, create_server

ROOT = Path(__file__).resolve().parents[2]


def served_metric_names(tmp_path) -> set[str]:
    config = ServerConfig(
        dir=str(tmp_path / "shard"), metrics_port=0, tables=(TableConfig.uniform("t", 16),)
    )
    running, _ = create_server(config)
    try:
        from urllib.request import urlopen

        with urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        running.stop(grace=1)
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.startswith("millpond_"):
            # the exposition's own names: counters with _total, histograms as declared
            names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_the_docs_table_lists_exactly_the_metrics_served(tmp_path):
    text = (ROOT / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(millpond_[a-z_]+)` \|", text, flags=re.M))
    assert documented == served_metric_names(tmp_path)


def test_the_dashboard_queries_only_metrics_served(tmp_path):
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "millpond.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    served = served_metric_names(tmp_path)
    used = set()
    for expr in exprs:
        for name in re.findall(r"millpond_[a-z_]+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)  # a histogram's series
            used.add(base if base in served else name)
    assert used <= served
    assert len(used) >= 12  # the dashboard shows most of them
