"""`specdec drafts list | load MODEL | unload MODEL`: manage a running server's drafts through
`/admin/drafts` (the server must have an API key: --api-key or $SPECDEC_API_KEY)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drafts", help="list, load or unload a running server's draft models")
    p.add_argument("action", choices=["list", "load", "unload"])
    p.add_argument("model", nargs="?", help="registry name or path (load), or a draft's id (unload)")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--api-key", default=None, help="default: $SPECDEC_API_KEY")
    p.set_defaults(func=cmd_drafts)


def cmd_drafts(a: argparse.Namespace) -> int:
    if a.action != "list" and not a.model:
        raise ValueError(f"`specdec drafts {a.action}` needs a model")
    key = a.api_key or os.environ.get("SPECDEC_API_KEY")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    url = a.url.rstrip("/") + "/admin/drafts"
    body = None if a.action == "list" else json.dumps({"action": a.action, "model": a.model}).encode()
    req = urllib.request.Request(url, data=body, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            report = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ValueError(f"{url}: HTTP {e.code}: {message}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"{url}: {e.reason}") from None
    for d in report["drafts"]:
        extra = f" ({d['error']})" if d.get("error") else ""
        pin = " pinned" if d["pinned"] else ""
        print(f"{d['id']:40s} {d['state']:9s}{pin}{extra}", file=sys.stderr)
    print(json.dumps(report))
    return 0
