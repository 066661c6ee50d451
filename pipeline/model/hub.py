"""Targets named the way vLLM and speculators name them: a Hugging Face hub
id ("ORG/NAME", with [model] revision) found in the local hub cache.

The cache is huggingface_hub's own (HF_HOME / HF_HUB_CACHE; HF_HUB_OFFLINE is
honoured): an id is resolved with `snapshot_download(..., local_files_only=True)`,
so a target is found exactly where `hf download`, vLLM and transformers put it,
and nothing goes to the network. Only with `[model] download = true` does
the first stage that runs download what the cache lacks (`fetch`, with
progress events in bytes and files), and the launch asks the Hub which commit
the revision is (`remote_listing`).

A run freezes the resolved snapshot when it is created or launched
(`freeze`: repo id, revision asked, commit, path, in state.json's `target`):
its stages, resumes and doctor use that commit even after `main` moved on
in the cache (`apply_pin`, `loading_run`); a snapshot that is gone is named
with the `hf download ... --revision <commit>` that restores it.

Where huggingface_hub is not installed (a panel-only environment) a cached
snapshot is still found by reading the cache's layout (refs/<revision>,
snapshots/<commit>), the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REVISION = "main"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


class HubError(Exception):
    """A hub target that cannot be used from the local cache; the message
    names the id, the revision, the cache and the command that fixes it
    (pipeline.config raises it as a ConfigError: this module sits below it)."""


class RemoteError(Exception):
    """The Hub refused or could not be asked (gated, missing, offline)."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix


@dataclass
class Snapshot:
    repo_id: str
    revision: str       # as asked: a branch, a tag or a commit
    commit: str
    path: Path
    pinned: bool = False   # the run's frozen snapshot (not what the revision is now)

    def as_dict(self) -> dict:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit,
                "path": str(self.path)}


# -- names -------------------------------------------------------------------

def is_hub_id(value: str) -> bool:
    """"ORG/NAME" as the Hub spells repository ids (no "--" or "..")."""
    return bool(_ID.match(value)) and "--" not in value and ".." not in value \
        and len(value.split("/")[1]) <= 96


def is_hub_target(cfg) -> bool:
    """The config's target is a hub id: not a built-in, and no local path of
    that name exists (a path that exists wins)."""
    from pipeline import builtin
    t = cfg.model.target
    return t not in builtin.TARGETS and is_hub_id(t) and not cfg.resolve(t).exists()


def revision_of(cfg) -> str:
    return cfg.model.revision or DEFAULT_REVISION


def download_command(repo_id: str, revision: str) -> str:
    return f"hf download {repo_id} --revision {revision}"


def cache_dir() -> Path:
    """huggingface_hub's cache folder (HF_HUB_CACHE, else HF_HOME/hub)."""
    try:
        from huggingface_hub import constants
        return Path(constants.HF_HUB_CACHE).expanduser()
    except ImportError:
        env = os.environ
        if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
            return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
        return Path(home).expanduser() / "hub"


def repo_folder(repo_id: str) -> Path:
    return cache_dir() / ("models--" + repo_id.replace("/", "--"))


def cached_revisions(repo_id: str) -> list[str]:
    """The refs (branches, tags) and snapshots the cache holds for a repo."""
    folder = repo_folder(repo_id)
    refs = sorted(str(p.relative_to(folder / "refs")) for p in (folder / "refs").rglob("*")
                  if p.is_file()) if (folder / "refs").is_dir() else []
    snaps = sorted(p.name for p in (folder / "snapshots").iterdir()) \
        if (folder / "snapshots").is_dir() else []
    return refs + snaps


# -- the local cache -----------------------------------------------------------

def resolve_cached(repo_id: str, revision: str) -> Snapshot:
    """The cached snapshot of `revision` (a branch, tag or commit), without
    the network; HubError says what the cache lacks and how to get it."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        path = _read_cache(repo_id, revision)
    else:
        try:
            path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
        except Exception as e:  # noqa: BLE001 - any failure of a local look-up: not cached
            raise HubError(_not_cached(repo_id, revision, e)) from None
    return Snapshot(repo_id, revision, path.name, path)


def _read_cache(repo_id: str, revision: str) -> Path:
    """The cache's layout read directly (no huggingface_hub here)."""
    folder = repo_folder(repo_id)
    commit = revision
    if not _COMMIT.match(revision):
        ref = folder / "refs" / revision
        if not ref.is_file():
            raise HubError(_not_cached(repo_id, revision, None))
        commit = ref.read_text().strip()
    path = folder / "snapshots" / commit
    if not path.is_dir():
        raise HubError(_not_cached(repo_id, revision, None))
    return path


def _not_cached(repo_id: str, revision: str, why: Exception | None) -> str:
    cache = cache_dir()
    have = cached_revisions(repo_id)
    if not have:
        what = f"the Hugging Face cache ({cache}) has no snapshot of {repo_id}"
    else:
        what = (f"the Hugging Face cache ({cache}) has {repo_id} but not revision {revision!r} "
                f"(cached: {', '.join(have)})")
        if why is not None and type(why).__name__ == "IncompleteSnapshotError":
            what = f"the cached snapshot of {repo_id} at {revision!r} is incomplete ({why})"
    return (f"{what}. Download it: `{download_command(repo_id, revision)}` (HF_HOME / "
            "HF_HUB_CACHE choose the cache), or set [model] download = true to let the first "
            "stage download it")


# -- what a run freezes --------------------------------------------------------

_LOADING: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hub_loading_run",
                                                                        default=None)


@contextlib.contextmanager
def loading_run(pin: dict | None):
    """While a run's frozen config is loaded, its target is checked against
    the snapshot the run froze (not against what the revision is now)."""
    token = _LOADING.set(pin)
    try:
        yield
    finally:
        _LOADING.reset(token)


def apply_pin(cfg, pin: dict | None):
    """Give a run's config the snapshot the run froze (state.json `target`)."""
    if pin and pin.get("repo_id") == cfg.model.target and is_hub_target(cfg):
        cfg.model.pinned = dict(pin)
    return cfg


def _pin_of(cfg) -> dict | None:
    pin = getattr(cfg.model, "pinned", None)
    return pin if pin and pin.get("repo_id") == cfg.model.target else None


def _pinned_snapshot(pin: dict) -> Snapshot:
    repo, commit = pin["repo_id"], pin["commit"]
    try:
        snap = resolve_cached(repo, commit)
    except HubError:
        recorded = Path(pin.get("path") or "")
        if pin.get("path") and recorded.is_dir():   # a cache the stage's environment lacks
            snap = Snapshot(repo, commit, commit, recorded)
        else:
            raise HubError(gone_message(pin)) from None
    snap.revision, snap.pinned = pin.get("revision") or commit, True
    return snap


def gone_message(pin: dict) -> str:
    repo, commit = pin["repo_id"], pin["commit"]
    return (f"`model.target` = {repo!r}: the snapshot this run started with (revision "
            f"{pin.get('revision')!r} = commit {commit}, {pin.get('path')}) is gone from the "
            f"Hugging Face cache ({cache_dir()}). Restore it: "
            f"`{download_command(repo, commit)}`; or start over on what "
            f"{pin.get('revision')!r} is now with `eagle-panel run` (the stages that read the "
            "target run again)")


def snapshot(cfg) -> Snapshot:
    """The target's snapshot: the run's frozen one, else the cached revision."""
    pin = _pin_of(cfg)
    if pin:
        return _pinned_snapshot(pin)
    return resolve_cached(cfg.model.target, revision_of(cfg))


def target_path(cfg) -> Path:
    return snapshot(cfg).path


def commit_of(cfg) -> str | None:
    """The commit a hub target is at (frozen, else cached), None when unknown."""
    pin = _pin_of(cfg)
    if pin:
        return pin["commit"]
    try:
        return resolve_cached(cfg.model.target, revision_of(cfg)).commit
    except HubError:
        return None


def check_config(cfg, src: str) -> None:
    """Config load: an id must be in the cache (or, for a run's frozen config,
    the snapshot the run froze must be), unless [model] download = true.
    Nothing goes to the network."""
    loading = _LOADING.get()
    frozen = bool(loading and loading.get("repo_id") == cfg.model.target)
    try:
        if frozen:
            _pinned_snapshot(loading)
        else:
            resolve_cached(cfg.model.target, revision_of(cfg))
    except HubError as e:
        if cfg.model.download:
            return
        if frozen:
            raise HubError(f"{src}: {e}.") from None
        raise HubError(f"{src}: `model.target` = {cfg.model.target!r} is not a local folder "
                       f"({cfg.resolve(cfg.model.target)} does not exist), and {e}.") from None


def freeze(cfg) -> dict | None:
    """The snapshot a run is created / launched with (for state.json): the
    cached revision, or with [model] download = true and nothing cached, the
    commit the Hub names for it (downloaded later by the first stage)."""
    if not is_hub_target(cfg):
        return None
    try:
        return resolve_cached(cfg.model.target, revision_of(cfg)).as_dict()
    except HubError:
        if not cfg.model.download:
            raise
    try:
        commit, _ = remote_listing(cfg.model.target, revision_of(cfg))
    except RemoteError as e:
        raise HubError(f"`model.target` = {cfg.model.target!r}: {e} {e.fix}".strip()) from None
    return {"repo_id": cfg.model.target, "revision": revision_of(cfg), "commit": commit,
            "path": str(repo_folder(cfg.model.target) / "snapshots" / commit)}


def model_identity(cfg) -> dict:
    """What of [model] decides a stage's output, for its fingerprint: a hub
    target by the commit it resolves to (not by how the revision is spelled,
    nor by whether it may be downloaded); other targets as before."""
    d = dataclasses.asdict(cfg.model)
    revision, _ = d.pop("revision", ""), d.pop("download", False)
    if is_hub_target(cfg):
        commit = commit_of(cfg)
        d["commit"] = commit
        if commit is None:
            d["revision"] = revision or DEFAULT_REVISION
    return d


# -- the files vLLM needs ------------------------------------------------------

def missing_from(names: set[str], index: dict | None = None) -> list[str]:
    """What vLLM (and the stages) need that `names` (paths relative to the
    snapshot) lacks: config.json, the weights (every shard an index names),
    the tokenizer."""
    from fnmatch import fnmatch
    top = {n for n in names if "/" not in n}
    out = []
    if "config.json" not in top:
        out.append("config.json")
    weights = [n for n in top if any(fnmatch(n, p) for p in WEIGHT_PATTERNS)]
    shards = sorted(set((index or {}).get("weight_map", {}).values()))
    if shards:
        lost = [s for s in shards if s not in names]
        if lost:
            out.append(f"weight shards the index names: {', '.join(lost[:4])}"
                       + (f" (+{len(lost) - 4} more)" if len(lost) > 4 else "")
                       + f" ({len(lost)} of {len(shards)})")
    elif not weights:
        out.append("weights (no *.safetensors)")
    if not top & set(TOKENIZER_FILES) and not any(n.endswith(".tiktoken") for n in top):
        out.append("tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...)")
    return out


def local_files(folder: Path) -> set[str]:
    """Files under a snapshot that are there (a link to a removed blob is not)."""
    out = set()
    for root, _, files in os.walk(folder):
        for f in files:
            p = Path(root) / f
            if p.exists():
                out.add(str(p.relative_to(folder)))
    return out


def missing_files(folder: Path) -> list[str]:
    names = local_files(folder)
    index = None
    for name in WEIGHT_INDEXES:
        if name in names:
            try:
                index = json.loads((folder / name).read_text())
            except (OSError, ValueError):
                return [f"{name} (unreadable)"]
            break
    return missing_from(names, index)


def size_on_disk(folder: Path) -> int:
    """Bytes of the snapshot's files (its blobs, each counted once)."""
    seen, total = set(), 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                st = (Path(root) / f).stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _size(n: int) -> str:
    return f"{n / (1 << 30):,.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


# -- the Hub (only with [model] download = true) -----------------------------

def endpoint() -> str:
    try:
        from huggingface_hub import constants
        return constants.ENDPOINT
    except ImportError:
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def remote_listing(repo_id: str, revision: str) -> tuple[str, dict[str, int]]:
    """(commit, {path: size}) of a revision on the Hub: the requests
    snapshot_download itself makes first (repo info, then the file tree)."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile
    except ImportError:
        raise RemoteError("huggingface_hub is not installed here, so the Hub cannot be asked",
                          "install it (pip install huggingface_hub), or download the model "
                          f"first: `{download_command(repo_id, revision)}`") from None
    api = HfApi()
    try:
        info = api.model_info(repo_id, revision=revision)
        files = {f.path: int(f.size or 0) for f in api.list_repo_tree(
            repo_id, revision=info.sha, recursive=True) if isinstance(f, RepoFile)}
    except Exception as e:  # noqa: BLE001 - every refusal becomes one finding
        raise _remote_error(repo_id, revision, e) from None
    return info.sha, files


def _remote_error(repo_id: str, revision: str, e: Exception) -> RemoteError:
    from huggingface_hub import constants, errors
    name, where = type(e).__name__, f"{endpoint()}/{repo_id}"
    offline = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)()
    if isinstance(e, errors.GatedRepoError) or name == "GatedRepoError":
        return RemoteError(f"{repo_id} is gated on the Hub ({where}): its files need an "
                           "accepted access request and a token",
                           f"request access at {where}, then log in (`hf auth login` or "
                           "HF_TOKEN) and launch again")
    if isinstance(e, errors.RevisionNotFoundError):
        return RemoteError(f"{repo_id} has no revision {revision!r} on the Hub ({where})",
                           "fix [model] revision (a branch, tag or commit)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return RemoteError(f"{repo_id} is not on the Hub ({where}), or is private",
                           "fix [model] target, or log in (`hf auth login`) for a private one")
    if name == "OfflineModeIsEnabled" or offline:
        return RemoteError(f"{repo_id} is not in the cache ({cache_dir()}) and HF_HUB_OFFLINE "
                           "is set, so [model] download = true cannot download it",
                           f"unset HF_HUB_OFFLINE, or `{download_command(repo_id, revision)}` "
                           "where the Hub can be reached")
    return RemoteError(f"the Hub ({endpoint()}) could not be asked about {repo_id}: "
                       f"{name}: {str(e)[:300]}",
                       "check the network (HF_ENDPOINT, proxies), or download it where the Hub "
                       f"can be reached: `{download_command(repo_id, revision)}`")


def download_pending(cfg) -> bool:
    """[model] download = true and the snapshot the run needs is not (all)
    in the cache yet."""
    if not (is_hub_target(cfg) and cfg.model.download):
        return False
    try:
        return bool(missing_files(snapshot(cfg).path))
    except HubError:
        return True


def remote_config(cfg) -> tuple[dict, bool, int | None]:
    """(config.json, tokenizer has auto_map, weight bytes) of a target not
    downloaded yet, from the Hub (into a temporary folder, never the cache)."""
    from huggingface_hub import hf_hub_download
    pin = _pin_of(cfg)
    repo = cfg.model.target
    commit, files = remote_listing(repo, pin["commit"] if pin else revision_of(cfg))
    out = []
    with tempfile.TemporaryDirectory(prefix="eagle-panel-hub-") as tmp:
        for name in ("config.json", "tokenizer_config.json"):
            if name not in files:
                out.append({})
                continue
            try:
                p = hf_hub_download(repo, name, revision=commit, local_dir=tmp)
                out.append(json.loads(Path(p).read_text() or "{}"))
            except Exception as e:  # noqa: BLE001
                raise _remote_error(repo, commit, e) from None
    if not out[0]:
        raise RemoteError(f"{repo} at {commit[:12]} has no config.json on the Hub")
    weights = sum(s for n, s in files.items() if n.endswith(".safetensors")) or None
    return out[0], "auto_map" in out[1], weights


def report(cfg) -> list[tuple[str, str, str]]:
    """doctor's lines about a hub target, (level, message, fix): the id, the
    revision and its commit, the snapshot path, its size on disk, and whether
    every file vLLM needs is there (or, to be downloaded, on the Hub)."""
    if not is_hub_target(cfg):
        return []
    repo = cfg.model.target
    try:
        snap = snapshot(cfg)
    except HubError as e:
        if not cfg.model.download:
            return [("blocking", str(e), "")]
        return _remote_report(cfg)
    where = (f"{repo} revision {snap.revision!r} = commit {snap.commit[:12]}"
             + (" (this run's frozen snapshot)" if snap.pinned else "")
             + f": {snap.path}, {_size(size_on_disk(snap.path))} on disk")
    lacks = missing_files(snap.path)
    if not lacks:
        names = local_files(snap.path)
        weights = sorted(n for n in names if n.endswith((".safetensors", ".bin")))
        return [("ok", f"{where}; every file vLLM needs is there (config.json, "
                 f"{len(weights)} weight file(s), tokenizer)", "")]
    if cfg.model.download:
        return [("ok", f"{where}; missing {'; '.join(lacks)}: the first stage downloads them "
                 "([model] download = true)", "")]
    return [("blocking", f"{where}; missing what vLLM needs: {'; '.join(lacks)}",
             f"`{download_command(repo, snap.commit)}` completes the snapshot (a gated "
             "repository needs an accepted access request and `hf auth login` first); or set "
             "[model] download = true")]


def _remote_report(cfg) -> list[tuple[str, str, str]]:
    repo, pin = cfg.model.target, _pin_of(cfg)
    rev = pin["commit"] if pin else revision_of(cfg)
    try:
        commit, files = remote_listing(repo, rev)
    except RemoteError as e:
        return [("blocking", str(e), e.fix)]
    lacks = missing_from(set(files))
    where = (f"{repo} revision {rev!r} = commit {commit[:12]} is not in the cache "
             f"({cache_dir()}); on the Hub: {len(files)} files, {_size(sum(files.values()))}")
    if lacks:
        return [("blocking", f"{where}; the repository lacks what vLLM needs: "
                 f"{'; '.join(lacks)}", "choose another [model] target or revision")]
    return [("ok", f"{where}; the first stage downloads them ([model] download = true)", "")]


# -- the download --------------------------------------------------------------

def fetch(cfg, progress=None, check_stop=None, say=print) -> Snapshot | None:
    """[model] download = true: download what the cache lacks of the run's
    snapshot (snapshot_download, resumable), with `progress(done, total,
    unit)` in bytes and in files. A no-op for other targets and when the
    snapshot is complete; never called without download = true."""
    if not (is_hub_target(cfg) and cfg.model.download):
        return None
    repo, pin = cfg.model.target, _pin_of(cfg)
    asked = pin.get("revision") if pin else revision_of(cfg)
    revision = pin["commit"] if pin else asked
    try:
        snap = snapshot(cfg)
        if not missing_files(snap.path):
            return snap
    except HubError:
        pass
    from huggingface_hub import snapshot_download
    say(f"downloading {repo} at {revision} into {cache_dir()}", flush=True)
    started = time.time()
    try:
        path = Path(snapshot_download(repo, revision=revision,
                                      tqdm_class=_reporting_bar(progress, check_stop)))
    except Exception as e:  # an Interrupted (check_stop) goes through as it is
        if type(e).__name__ == "Interrupted":
            raise
        raise _remote_error(repo, revision, e) from None
    if asked and not _COMMIT.match(asked):
        _write_ref(repo, asked, path.name)
    names = local_files(path)
    total = size_on_disk(path)
    if progress is not None:
        progress(total, total, "bytes", what="download")
        progress(len(names), len(names), "files", what="download")
    say(f"downloaded {repo} at {path.name[:12]}: {len(names)} files, {_size(total)} in "
        f"{time.time() - started:.1f} s", flush=True)
    return Snapshot(repo, asked or revision, path.name, path, pinned=bool(pin))


def _write_ref(repo_id: str, revision: str, commit: str) -> None:
    """refs/<revision> as snapshot_download writes it, when the cache has no
    such ref yet (a pinned commit was downloaded): never moves an existing one."""
    ref = repo_folder(repo_id) / "refs" / revision
    if ref.exists():
        return
    with contextlib.suppress(OSError):
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)


def _reporting_bar(progress, check_stop, every_s: float = 0.5):
    """A tqdm class for snapshot_download that reports its byte total (the
    bar named "huggingface_hub.snapshot_download") and its file count (the
    thread map's bar) as progress events, and prints nothing."""
    import threading

    from huggingface_hub.utils import tqdm as hf_tqdm
    lock = threading.Lock()   # the byte bar is updated from every download thread

    class Reporting(hf_tqdm):
        def __init__(self, *args, **kwargs):
            name = kwargs.get("name")
            unit = kwargs.get("unit", "it")
            self._kind = ("bytes" if name == "huggingface_hub.snapshot_download" else
                          "files" if unit != "B" and name is None else None)
            self._done, self._last = int(kwargs.get("initial") or 0), 0.0
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if check_stop is not None:
                check_stop()
            with lock:
                self._done += int(n or 0)
                now = time.monotonic()
                due = self._kind and progress is not None and now - self._last >= every_s
                if due:
                    self._last = now
                    progress(self._done, int(self.total or 0) or None, self._kind,
                             what="download")
            return super().update(n)

    return Reporting
