"""STAND-IN for the Hugging Face Hub, for the tests of `[model] download = true`
(tests/unit/test_hub_targets.py) on a machine that must not reach the network: an
http.server on 127.0.0.1 that answers the requests huggingface_hub's
`snapshot_download` and `hf_hub_download` make (read from huggingface_hub
2.4's code), with HF_ENDPOINT pointed at it. It is not the Hub: it knows
only what is below, and it never offers the Xet route.

- GET  /api/models/{org}/{name}/revision/{rev}   repo info: `id`, `sha` (the
  commit the revision is), `siblings`
- GET  /api/models/{org}/{name}/tree/{rev}        the file tree (`type`, `path`,
  `size`, `oid`; one page, no Link header; no `xetHash`, so no Xet download)
- HEAD /{org}/{name}/resolve/{rev}/{path}         X-Repo-Commit, ETag (the
  sha256 of the content: the blob's name in the cache), Content-Length
- GET  /{org}/{name}/resolve/{rev}/{path}         the bytes (a `Range: bytes=N-`
  resumes)

Errors carry the X-Error-Code huggingface_hub maps to its exceptions:
RepoNotFound, RevisionNotFound, EntryNotFound, and GatedRepo for a repository
listed as gated. Every request is recorded in `requests` ((method, path)).
"""

from __future__ import annotations

import hashlib
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    revisions: dict[str, str] = field(default_factory=dict)   # branch/tag -> commit
    gated: bool = False

    def commit_of(self, rev: str) -> str | None:
        if rev == self.commit:
            return self.commit
        return self.revisions.get(rev)


def folder_files(folder: Path) -> dict[str, bytes]:
    """A model folder's files, as a repository's content."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


class FakeHub:
    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # quiet
                pass

            def do_GET(self):
                hub._serve(self, body=True)

            def do_HEAD(self):
                hub._serve(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- routes ------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision",
                                                                               "tree"):
            repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            repo = self._repo(h, repo_id, body)
            if repo is None:
                return
            commit = repo.commit_of(rev)
            if commit is None:
                return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
            if kind == "revision":
                return _json(h, {"id": repo_id, "sha": commit, "private": False,
                                 "gated": False,
                                 "siblings": [{"rfilename": p} for p in repo.files]}, body)
            return _json(h, [{"type": "file", "path": p, "size": len(b),
                              "oid": hashlib.sha1(b).hexdigest()}
                             for p, b in repo.files.items()], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            repo = self._repo(h, repo_id, body)
            if repo is None:
                return
            commit = repo.commit_of(rev)
            if commit is None:
                return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
            data = repo.files.get(name)
            if data is None:
                return _error(h, 404, "EntryNotFound", f"{name} does not exist", body,
                              {"X-Repo-Commit": commit})
            start = 0
            rng = h.headers.get("Range", "")
            if rng.startswith("bytes=") and rng[6:].split("-")[0].isdigit():
                start = int(rng[6:].split("-")[0])
            h.send_response(206 if start else 200)
            h.send_header("X-Repo-Commit", commit)
            h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(len(data) - start))
            h.end_headers()
            if body:
                h.wfile.write(data[start:])
            return
        _error(h, 404, "", f"no route {path}", body)

    def _repo(self, h, repo_id: str, body: bool) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            _error(h, 404, "RepoNotFound", "Repository not found", body)
            return None
        if repo.gated:
            _error(h, 403, "GatedRepo", f"Access to model {repo_id} is restricted. You must "
                   "have access to it and be authenticated to access it.", body)
            return None
        return repo


def _json(h: BaseHTTPRequestHandler, obj, body: bool) -> None:
    data = json.dumps(obj).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)


def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str, body: bool,
           extra: dict | None = None) -> None:
    data = json.dumps({"error": message}).encode()
    h.send_response(status)
    if code:
        h.send_header("X-Error-Code", code)
    h.send_header("X-Error-Message", message)
    for k, v in (extra or {}).items():
        h.send_header(k, v)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    if body:
        h.wfile.write(data)
