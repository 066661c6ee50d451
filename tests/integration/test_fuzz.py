"""The hostile-input fuzz (tests/config_fuzz.py: five families, each case
exit 2 or its documented code, a message naming the file and key or line,
no traceback, nothing on disk changed, no process signalled), a few of its
cases through the real CLI where the exit status is the point, and
property tests (a seeded generator: hypothesis is not installed) for the
config loader and the event reader."""

from __future__ import annotations

import json
import math
import random
import string

import pytest

from tests import config_fuzz as fz
from tests.helpers import cli, stagekit_config

CASES = fz.cases()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with a finished run "t" (test stages) and its valid config:
    the fuzz's cases must leave both as they are."""
    tmp = tmp_path_factory.mktemp("fuzz")
    stagekit_config(tmp)
    cli("run", "--wait", cwd=tmp, check=0)
    return tmp, (tmp / "config.toml").read_bytes()


@pytest.fixture(scope="module")
def sentinel():
    proc = fz.sentinel_process()
    yield proc.pid
    proc.kill()
    proc.wait()


def test_the_fuzz_is_big_enough():
    counts = {f: sum(c.family == f for c in CASES) for f in fz.FAMILIES}
    assert len(CASES) >= 200 and all(n >= 25 for n in counts.values()), counts


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c.label[:60]}" for i, c in enumerate(CASES)])
def test_hostile_input(case, folder, sentinel):
    if case.xfail:
        pytest.xfail(case.xfail)
    tmp, base = folder
    try:
        with fz.in_folder(tmp):
            why = fz.run_case(case, tmp, base, sentinel)
    finally:
        (tmp / "config.toml").write_bytes(base)
    assert why is None, f"[{case.family}] {case.label}: {why}"


@pytest.mark.parametrize("argv, config, needle", [
    (["--config", "", "run"], None, "--config"),
    (["run", "--run", "../../elsewhere/x"], None, "--run"),
    (["run"], b'[run]\nname = "t"\n[stages.extract]\nserver_args = ["--host", "0.0.0.0"]\n',
     "stages.extract.server_args"),
    (["logs", "t", "train", "-n", "-5"], None, "-n"),
])
def test_the_real_cli_exits_2(argv, config, needle, folder):
    """Where the exit status is the point: the real `eagle-panel`, in a subprocess."""
    tmp, base = folder
    listing = sorted(x.name for x in (tmp / "runs").iterdir())
    (tmp / "config.toml").write_bytes(config or base)
    try:
        p = cli(*argv, cwd=tmp, check=2)
    finally:
        (tmp / "config.toml").write_bytes(base)
    assert needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(x.name for x in (tmp / "runs").iterdir()) == listing


def test_doctor_json_stays_json_on_a_bad_config(folder):
    tmp, base = folder
    (tmp / "config.toml").write_bytes(b"[run]\nname = 3\n")
    try:
        p = cli("doctor", "--json", cwd=tmp, check=2)
    finally:
        (tmp / "config.toml").write_bytes(base)
    report = json.loads(p.stdout)
    first = report["findings"][0]
    assert not report["ok"] and first["level"] == "blocking" and "run.name" in first["message"]


# -- properties --------------------------------------------------------------

def _random_value(rng: random.Random, depth: int = 0) -> str:
    """A TOML value of any kind (some of them valid for some key)."""
    kinds = ["int", "float", "str", "bool", "list", "table", "special", "date"]
    kind = rng.choice(kinds if depth < 2 else kinds[:4])
    if kind == "int":
        return str(rng.choice([0, 1, -1, 3, 7, 256, 10 ** 13, -(10 ** 13), rng.randrange(-99, 9999)]))
    if kind == "float":
        return repr(rng.choice([0.0, 0.5, 1.0, -0.5, 1e-4, 2.5, 1e300, rng.uniform(-10, 10)]))
    if kind == "str":
        alphabet = string.ascii_letters + string.digits + " -_.:çé"
        return json.dumps("".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12))))
    if kind == "bool":
        return rng.choice(["true", "false"])
    if kind == "list":
        return "[" + ", ".join(_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))) + "]"
    if kind == "table":
        return "{ " + ", ".join(f"K{i} = {_random_value(rng, depth + 1)}"
                                for i in range(rng.randrange(0, 3))) + " }"
    if kind == "special":
        return rng.choice(["inf", "-inf", "nan"])
    return "1979-05-27T07:32:00Z"


def _random_config(rng: random.Random) -> str:
    """Sections and keys from the real schema (and a few near misses), random values."""
    import dataclasses
    sections = fz._sections()
    lines = ['[run]\nname = "p"\nruns_dir = "runs"\n']
    for section, cls in rng.sample(sections, rng.randrange(1, 5)):
        if section == "run":
            continue
        lines.append(f"[{section}]")
        names = [f.name for f in dataclasses.fields(cls)]
        for key in rng.sample(names, min(len(names), rng.randrange(1, 4))):
            if key in ("target", "path", "python", "vllm_python", "prompts", "serve_command",
                       "render_endpoint", "entry"):
                continue   # (paths, commands and hub ids: the named cases cover them)
            key = key if rng.random() > 0.1 else key[:-1]
            lines.append(f"{key} = {_random_value(rng)}")
    return "\n".join(lines) + "\n"


def test_the_config_loader_accepts_or_explains_never_crashes(tmp_path):
    """Any document from the schema's keys and any values: a Config whose
    values have the declared types, or one ConfigError naming the file."""
    import dataclasses
    import typing

    from pipeline import config as c
    rng = random.Random(31)
    accepted = 0
    for _ in range(400):
        text = _random_config(rng)
        try:
            cfg = c.parse(text, "fuzz.toml", tmp_path)
        except c.ConfigError as e:
            assert str(e).startswith("fuzz.toml"), (text, e)
            continue
        accepted += 1
        for section, cls in fz._sections():
            obj = cfg
            for part in section.split("."):
                obj = getattr(obj, part)
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                v = getattr(obj, f.name)
                if hints[f.name] in (int, float):
                    assert not isinstance(v, bool) and math.isfinite(v) and v >= -1, (text, f.name)
                if hints[f.name] is bool:
                    assert isinstance(v, bool), (text, f.name)
    assert accepted > 10   # the generator reaches valid configs too


def _garbage_line(rng: random.Random) -> bytes:
    """A damaged events.jsonl line: not JSON, JSON of the wrong shape, fields
    of the wrong type, two objects on one line, bytes that are not UTF-8."""
    good = {"t": 1.5, "type": "progress", "stage": "extract", "done": 3, "total": 9}
    return rng.choice([
        b"{not json", b"", b"[]", b"3", b'"text"', b"null", b"\xff\xfe\x00",
        json.dumps({**good, "done": "lots"}).encode(), json.dumps({**good, "t": "now"}).encode(),
        json.dumps({"type": 5, "t": 1}).encode(), json.dumps(good)[:-3].encode(),
        (json.dumps(good) + ", " + json.dumps(good)).encode(),
        json.dumps({"t": 1, "type": "stage_finished", "summary": "x"}).encode(),
        b"[" * 5000, b'{"t": 1}', json.dumps({"t": [1], "type": "progress"}).encode(),
    ])


def test_the_event_reader_keeps_every_good_event_and_nothing_else(tmp_path):
    """A file of good events with damaged lines between them: every reader
    returns exactly the good ones, in order, and none raises."""
    from pipeline.run.events import EventTail, last_event, read_events, tail_events
    rng = random.Random(31)
    for trial in range(120):
        good, lines = [], []
        for i in range(rng.randrange(0, 30)):
            if rng.random() < 0.35:
                lines.append(_garbage_line(rng))
            else:
                ev = {"t": float(i), "type": "progress", "stage": "extract", "done": i,
                      "total": 99}
                good.append(ev)
                lines.append(json.dumps(ev, separators=(",", ":")).encode())   # as EventWriter
        path = tmp_path / f"events-{trial}.jsonl"
        tail = b"" if rng.random() < 0.5 else b'{"t": 9, "type": "progr'   # being written
        path.write_bytes(b"\n".join(lines) + (b"\n" if lines else b"") + tail)
        assert read_events(path) == good, path.read_bytes()[:2000]
        assert tail_events(path, 1000) == good
        assert last_event(path, ("progress",)) == (good[-1] if good else None)
        follower, seen = EventTail(path, chunk=rng.choice([7, 64, 1 << 20])), []
        size = path.stat().st_size
        for _ in range(10_000):   # in pieces, as a panel following a growing file reads it
            if follower.offset >= size:
                break
            seen += follower.poll(max_bytes=rng.choice([5, 33, 4096]))
        assert seen == good


def test_prepare_skips_a_row_whose_content_part_text_is_a_number(tmp_path):
    """A hostile row among good ones: skipped with its line and reason, counted;
    the stage goes on (it used to fail on a TypeError)."""
    from pipeline.builtin import conversations_path
    from pipeline.stages import prepare
    from tests.helpers import finished, run_body
    good = conversations_path().read_bytes().splitlines()[:6]
    bad = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": 42}]},
                                   {"role": "assistant", "content": "ok"}]}).encode()
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"\n".join(good[:3] + [bad] + good[3:]) + b"\n")
    code, _, evs = run_body(tmp_path, "prepare", prepare.body, f'[data]\npath = "{data}"\n')
    assert code == 0
    assert finished(evs)["summary"]["skipped_rows"] == 1
    warn = [e for e in evs if e["type"] == "warning"][0]
    assert warn["rows"][0]["line"] == 4 and "`text` is not a string" in warn["rows"][0]["reason"]
