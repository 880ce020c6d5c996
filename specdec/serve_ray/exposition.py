"""One Prometheus page for the deployment from each replica's own: every sample gets a `replica`
label, and the figures that add up across replicas (counters, histograms, request and block gauges)
also appear summed as `replica="all"`, with the acceptance rate recomputed from the summed tokens."""
from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

ALL = "all"
# gauges that add up over replicas; the others (rates, gains, states) are per replica only
ADDITIVE_GAUGES = {"specdec_num_requests_waiting", "specdec_num_requests_running", "specdec_kv_blocks_used",
                   "specdec_kv_blocks_free", "specdec_draft_cache_tokens", "specdec_draft_cache_bytes",
                   "specdec_draft_cache_sequences"}


def merge(pages: dict[str, str], extra: str = "") -> str:
    """`pages`: replica id -> its /metrics text. `extra`: the ingress's own families, appended."""
    families: dict[str, dict] = {}
    for replica, text in sorted(pages.items()):
        for fam in text_string_to_metric_families(text):
            entry = families.setdefault(fam.name, {"type": fam.type, "doc": fam.documentation, "samples": [],
                                                   "sums": defaultdict(float)})
            for s in fam.samples:
                entry["samples"].append((s.name, {**s.labels, "replica": replica}, s.value))
                if _adds_up(fam.type, fam.name, s.name):
                    entry["sums"][(s.name, tuple(sorted(s.labels.items())))] += s.value
    _acceptance(families)
    lines = []
    for name, fam in families.items():
        lines += [f"# HELP {name} {_escape_doc(fam['doc'])}", f"# TYPE {name} {fam['type']}"]
        lines += [_line(n, labels, v) for n, labels, v in fam["samples"]]
        lines += [_line(n, {**dict(labels), "replica": ALL}, v) for (n, labels), v in fam["sums"].items()]
    return "\n".join(lines) + "\n" + extra


def _adds_up(kind: str, family: str, sample: str) -> bool:
    if sample.endswith("_created"):
        return False  # a timestamp
    return kind in ("counter", "histogram", "summary") or (kind == "gauge" and family in ADDITIVE_GAUGES)


def _acceptance(families: dict[str, dict]) -> None:
    """specdec_spec_acceptance_rate{replica="all"} = summed accepted / summed drafted, per proposer."""
    drafted, accepted = families.get("specdec_spec_drafted_tokens"), families.get("specdec_spec_accepted_tokens")
    rate = families.get("specdec_spec_acceptance_rate")
    if not (drafted and accepted and rate):
        return
    took = {labels: v for (_, labels), v in accepted["sums"].items()}
    for (_, labels), n in drafted["sums"].items():
        if n > 0:
            rate["sums"][("specdec_spec_acceptance_rate", labels)] = took.get(labels, 0.0) / n


def _line(name: str, labels: dict[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{inner}}} {_number(value)}"


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_doc(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")
