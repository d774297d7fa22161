"""Our numbers beside the published ones, as suite.md (report.py) and report.html (html_report.py) print them:
the published columns (a model family each), the headline metric of each protocol, percent with two decimals,
"—" where nothing was published or scored."""

from __future__ import annotations

from typing import Sequence

from rsclip_ds.evaluation.catalog import CLASSIFICATION, RETRIEVAL, PublishedResult

FAMILIES = ("Git-RSCLIP", "RemoteCLIP", "GeoRSCLIP", "SkyCLIP")   # the published columns, in order
DASH = "—"
HEADLINE = {CLASSIFICATION: "top1", RETRIEVAL: "mean_recall"}     # the headline number of each protocol


def published_value(published: Sequence[PublishedResult], family: str, set_name: str,
                    protocol: str) -> PublishedResult | None:
    """The first published result of ``family`` (a model name prefix: "RemoteCLIP" matches
    "RemoteCLIP ViT-L-14") for this set and protocol's headline metric."""
    metric = HEADLINE[protocol]
    for p in published:
        if p.model.startswith(family) and p.set == set_name and p.metric == metric:
            return p
    return None


def percent(p: PublishedResult) -> float:
    return 100 * p.value if p.metric == "top1" else p.value


def pct(value: float | None) -> str:
    """A fraction of ours in percent, two decimals; DASH where there is none."""
    return DASH if value is None else f"{100 * value:.2f}"


def short_model(model: str) -> str:
    """A model's path or hub id -> its last part, for a column or a title."""
    return str(model).rstrip("/").rsplit("/", 1)[-1]
