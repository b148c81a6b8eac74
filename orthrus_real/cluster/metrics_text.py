"""The replicas' Prometheus texts as one exposition, each sample labelled with its ``replica``
(so ``sum without (replica) (...)`` is the cluster's figure and nothing is counted twice)."""

from __future__ import annotations

import re

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?( .*)$")
REPLICA = re.compile(r'(?:^|,)replica="(\d+)"')


def label_samples(text: str, replica: int) -> list[tuple[str, list[str]]]:
    """``[(family header lines, sample lines)]`` of one text, ``replica="N"`` added to each sample."""
    families: list[tuple[str, list[str]]] = []
    header: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            header.append(line)
            continue
        m = SAMPLE.match(line)
        if not m:
            continue
        name, labels, rest = m.groups()
        labels = f'replica="{replica}"' + (f",{labels}" if labels else "")
        if header:
            families.append(("\n".join(header), []))
            header = []
        elif not families:
            families.append(("", []))
        families[-1][1].append(f"{name}{{{labels}}}{rest}")
    return families


def merge(texts: dict[int, str]) -> str:
    """One exposition of every replica's text (``{replica: text}``): each family's header once,
    then its samples from every replica, families in the order first seen."""
    order: list[str] = []
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(texts.items()):
        for header, lines in label_samples(text, replica):
            if header not in samples:
                order.append(header)
                samples[header] = []
            samples[header].extend(lines)
    out = []
    for header in order:
        if header:
            out.append(header)
        out.extend(samples[header])
    return "\n".join(out) + "\n"


def sum_replicas(samples: dict[str, float]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """Parsed samples (``{'name{labels}': value}``) -> the cluster's (the ``replica`` label
    summed out) and each replica's own (without the label); a text without the label is one
    replica's, 0."""
    total: dict[str, float] = {}
    each: dict[int, dict[str, float]] = {}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        labels = labels.rstrip("}")
        m = REPLICA.search(labels)
        replica = int(m.group(1)) if m else 0
        if m:
            labels = REPLICA.sub("", labels, count=1).lstrip(",")
        bare = f"{name}{{{labels}}}" if labels else name
        total[bare] = total.get(bare, 0.0) + value
        each.setdefault(replica, {})[bare] = value
    return total, each


def replica_roles(samples: dict[str, float]) -> dict[int, str]:
    """``{replica: role}`` from the gateway's ``orthrus_cluster_replica_up`` (empty for a
    single server)."""
    out = {}
    for key in samples:
        if key.startswith("orthrus_cluster_replica_up{"):
            labels = key.partition("{")[2]
            m, role = REPLICA.search(labels), re.search(r'role="([^"]+)"', labels)
            if m and role:
                out[int(m.group(1))] = role.group(1)
    return out
