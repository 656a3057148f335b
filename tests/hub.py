"""A Hugging Face hub on localhost for the data tests: one or more dataset repositories, each a folder of files,
served over the hub's HTTP API as huggingface_hub and datasets call it (repo info, the file tree, paths-info,
`resolve` downloads with Range requests). Point a process at it with HF_ENDPOINT=hub.url. It counts the bytes of
each file it sends, so that a test can measure what a download cost, and can stall a file's download (to kill the
process that fetches it midway)."""

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

API = "/api/datasets/"
CHUNK = 4096  # bytes of a file sent at a time (a stalled download stops at a multiple of it)
RESOLVE = "/datasets/"


class Hub:
    """repos: {"org/name": {revision: folder}}; each folder's files (hidden ones left out) make that revision."""

    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.repos = repos
        self.sent: Counter = Counter()  # bytes of file bodies sent, by repository path
        self.requests: list[str] = []
        self.stall: dict[str, int] = {}  # path -> bytes after which a download of it hangs (until the client dies)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str, revision: str) -> dict[str, Path]:
        folder = self.repos[repo][revision]
        return {
            p.relative_to(folder).as_posix(): p
            for p in sorted(folder.rglob("*"))
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        }

    def commit(self, repo: str, revision: str) -> str:
        digest = hashlib.sha1(repo.encode() + revision.encode())
        for name, path in self.files(repo, revision).items():
            digest.update(name.encode() + path.read_bytes())
        return digest.hexdigest()

    def revision(self, repo: str, revision: str) -> str | None:
        """The revision a name or commit hash stands for (a commit hash: that of one of the repo's revisions)."""
        if revision in self.repos.get(repo, {}):
            return revision
        return next((r for r in self.repos.get(repo, {}) if self.commit(repo, r) == revision), None)

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def reply(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def json(self, value, headers: dict | None = None):
                self.reply(200, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})})

            def missing(self, code: str, head: bool = False):
                self.reply(404, b'{"error": "not found"}', {"X-Error-Code": code}, head)

            def do_HEAD(self):
                self.route(head=True)

            def do_GET(self):
                self.route(head=False)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode()
                self.route(head=False, body=body)

            def route(self, head: bool, body: str = ""):
                url = urlparse(self.path)
                hub.requests.append(f"{self.command} {unquote(url.path)}")
                if url.path.startswith(API):
                    self.api(url.path[len(API):], parse_qs(url.query), body)
                elif url.path.startswith(RESOLVE):
                    self.resolve(url.path[len(RESOLVE):], head)
                else:
                    self.missing("EntryNotFound", head)

            def split_repo(self, rest: str) -> tuple[str, str, list[str]]:
                parts = rest.split("/")
                return "/".join(parts[:2]), parts[2] if len(parts) > 2 else "", parts[3:]

            def api(self, rest: str, query: dict, body: str):
                repo, verb, tail = self.split_repo(rest)
                if repo not in hub.repos:
                    return self.reply(401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                revision = hub.revision(repo, unquote(tail[0])) if tail and verb != "refs" else "main"
                if revision is None:
                    return self.reply(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
                files = hub.files(repo, revision)
                sha = hub.commit(repo, revision)
                if verb == "revision" or (verb == "" and not tail):
                    return self.json({"id": repo, "sha": sha, "private": False, "disabled": False, "gated": False,
                                      "siblings": [{"rfilename": name} for name in files]})
                if verb == "tree":
                    prefix = "/".join(unquote(t) for t in tail[1:]).strip("/")
                    recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                    return self.json(self.tree(files, prefix, recursive))
                if verb == "refs":
                    def ref(name):
                        return {"name": name.split("/")[-1], "ref": name, "targetCommit": hub.commit(repo, name)}
                    return self.json({
                        "branches": [ref(r) for r in hub.repos[repo] if not r.startswith("refs/")],
                        "converts": [ref(r) for r in hub.repos[repo] if r.startswith("refs/convert/")],
                        "tags": [], "pullRequests": []})
                if verb == "paths-info":
                    asked = parse_qs(body).get("paths", [])
                    if not asked and body.startswith("{"):
                        asked = json.loads(body).get("paths", [])
                    return self.json([e for e in self.tree(files, "", True) if e["path"] in asked])
                return self.missing("EntryNotFound")

            def tree(self, files: dict[str, Path], prefix: str, recursive: bool) -> list[dict]:
                entries, folders = [], set()
                for name, path in files.items():
                    if prefix and not name.startswith(prefix + "/"):
                        continue
                    rest = name[len(prefix) + 1:] if prefix else name
                    parents = rest.split("/")[:-1]
                    for depth in range(1, len(parents) + 1 if recursive else min(1, len(parents)) + 1):
                        folders.add("/".join(filter(None, [prefix, *parents[:depth]])))
                    if recursive or not parents:
                        entries.append({"type": "file", "oid": blob_id(path), "size": path.stat().st_size,
                                        "path": name})
                return [{"type": "directory", "oid": "0" * 40, "size": 0, "path": f} for f in sorted(folders)] + entries

            def resolve(self, rest: str, head: bool):
                repo, _, tail = self.split_repo(rest)
                # /datasets/org/name/resolve/REVISION/path/in/repo
                if repo not in hub.repos or len(tail) < 2:
                    return self.reply(401, b"", {"X-Error-Code": "RepoNotFound"}, head)
                revision = hub.revision(repo, unquote(tail[0]))
                if revision is None:
                    return self.reply(404, b"", {"X-Error-Code": "RevisionNotFound"}, head)
                name = unquote("/".join(tail[1:]))
                path = hub.files(repo, revision).get(name)
                if path is None:
                    return self.missing("EntryNotFound", head)
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                headers = {"ETag": f'"{etag}"', "X-Repo-Commit": hub.commit(repo, revision),
                           "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                start, status = 0, 200
                if (ranged := self.headers.get("Range")) and ranged.startswith("bytes="):
                    first, _, last = ranged[len("bytes="):].partition("-")
                    start = int(first or 0)
                    end = int(last) + 1 if last else len(data)
                    headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                    data, status = data[start:end], 206
                if head:
                    return self.reply(status, b"", {**headers, "Content-Length": str(len(data))}, head=True)
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                stall = hub.stall.get(name)
                for offset in range(0, len(data), CHUNK):
                    chunk = data[offset: offset + CHUNK]
                    if stall is not None and offset + len(chunk) > stall:
                        threading.Event().wait()  # hangs until the process that fetches it is killed
                    try:
                        self.wfile.write(chunk)
                    except OSError:
                        return
                    hub.sent[name] += len(chunk)

        return Handler


def blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
