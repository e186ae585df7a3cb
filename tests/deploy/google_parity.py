"""Flatten two JobSets into comparable paths (lists of named items keyed by name, ports by number, flags by
name) and diff them: what tests/deploy/test_google_parity.py checks against pathwaysutils' own JobSet."""

from __future__ import annotations

from typing import Any

# pathwaysutils names its replicated Jobs pathways-head / pathways-worker; ours are head / workers.
REPLICATED_JOB_NAMES = {"pathways-head": "head", "pathways-worker": "workers"}


def _flag(arg: str) -> tuple[str, str]:
    name, eq, value = arg.partition("=")
    return (name, value) if eq and name.startswith("--") else (arg, "")


def flatten(obj: Any, path: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{path}.{k}" if path else k, out)
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) and "containerPort" in x for x in obj):
        for x in obj:
            flatten({k: v for k, v in x.items() if k != "containerPort"}, f"{path}[{x['containerPort']}]", out)
            out.setdefault(f"{path}[{x['containerPort']}]", "present")
    elif isinstance(obj, list) and obj and all(isinstance(x, dict) and "name" in x for x in obj):
        for x in obj:
            name = REPLICATED_JOB_NAMES.get(x["name"], x["name"]) if path.endswith("replicatedJobs") else x["name"]
            flatten({k: v for k, v in x.items() if k != "name"}, f"{path}[{name}]", out)
            out.setdefault(f"{path}[{name}]", "present")
    elif isinstance(obj, list) and path.endswith(".args") and all(isinstance(x, str) for x in obj):
        i = 0
        while i < len(obj):
            name, value = _flag(obj[i])
            if name.startswith("--") and "=" not in obj[i] and i + 1 < len(obj) and not obj[i + 1].startswith("--"):
                value, i = obj[i + 1], i + 1  # "--flag value"
            out[f"{path}[{name}]"] = value
            i += 1
    else:
        out[path] = obj
    return out


def diff(google: dict[str, Any], ours: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """path -> (Google's value or None when absent, ours or None when absent), for every path that differs."""
    g, o = flatten(google), flatten(ours)
    missing = object()
    out = {}
    for k in sorted(set(g) | set(o)):
        a, b = g.get(k, missing), o.get(k, missing)
        if a != b:
            out[k] = (None if a is missing else a, None if b is missing else b)
    return out
