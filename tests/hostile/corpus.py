"""A corpus of hostile checkpoints, generated (FIFOs, symlinks and sparse files cannot be
committed to git): each case is a checkpoint root holding a good step 1 and a hostile step 2
(or a hostile root), next to an `outside/` directory of decoys that nothing may read.

    python tests/hostile/corpus.py OUTDIR        # build it and list the cases
    from hostile.corpus import build             # -> list[Case] (tests/ is on sys.path)

Every hostile manifest comes with a commit marker that matches it (what someone who knows the
format can write), and shards whose manifest size and checksum are re-computed, so that only the
structural checks can refuse them. `expect` says what a reader must do:

  refused   restore falls back to step 1 (a warning names step 2); the readers raise
            CorruptCheckpointError / UnsafeCheckpointError whose message contains `message`
  ignored   the planted file is never opened; step 2 itself is intact and restores
  bounded   the checkpoint is well-formed and may load; memory stays within `max_growth`
  root      a hostile checkpoint root (event log, lock, .inprogress): nothing hangs or crashes
  unreadable  a step this version cannot read (a newer format, over a read cap), never "corrupt":
            the readers raise UnreadableCheckpointError containing `message`; restore refuses
            (no fall back to step 1, which a later save of step 2 would overwrite from)
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

SHARD = "rank-00000-of-00001.safetensors"
BOMB = 2 << 20  # bytes of the JSON bomb
# What reading a small checkpoint may add to RSS: 64 MiB, plus the shard writer's two staging
# buffers (2 x writer.CHUNK) that `export` uses. A hostile size claim must not add more.
BASE_GROWTH = (64 << 20) + 2 * (32 << 20)


@dataclass
class Case:
    name: str
    expect: str  # refused | ignored | bounded | root
    message: str = ""  # a substring of the refusal
    load_time: bool = False  # refused only when the shard is read (inspect_dir may pass it)
    max_growth: int = BASE_GROWTH  # bytes of RSS the whole battery of readers may add
    root: Path = Path()
    outside: Path = Path()

    @property
    def step2(self) -> Path:
        return self.root / "step_000000002"


# -- building blocks ----------------------------------------------------------------------------

def _xxh(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_bytes())


def _write_manifest(d: Path, raw: bytes, step: int = 2) -> None:
    from slurmresume.checkpoint.manifest import marker_bytes

    (d / "manifest.json").write_bytes(raw)
    (d / "COMMITTED").write_bytes(marker_bytes(step, raw))


def _edit_manifest(edit: Callable[[dict], Any]) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        from helpers.core import edit_rows

        m = _manifest(c.step2)
        edit_rows(m, edit)
        _write_manifest(c.step2, json.dumps(m, separators=(",", ":")).encode())
    return craft


def _raw_manifest(make: Callable[[bytes], bytes]) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        _write_manifest(c.step2, make((c.step2 / "manifest.json").read_bytes()))
    return craft


def _replace_shard(data: bytes, c: Case) -> None:
    """Put `data` in place of step 2's shard, with a manifest (and marker) that match it."""
    (c.step2 / SHARD).unlink(missing_ok=True)
    (c.step2 / SHARD).write_bytes(data)

    def edit(m: dict) -> None:
        m["shards"][0]["bytes"] = len(data)
        m["shards"][0]["xxh3"] = _xxh(data)
    _edit_manifest(edit)(c)


def _split(shard: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", shard[:8])
    return json.loads(shard[8:8 + n]), shard[8 + n:]


def _join(header: dict | bytes, body: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _edit_header(edit: Callable[[dict], Any]) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        header, body = _split((c.step2 / SHARD).read_bytes())
        edit(header)
        _replace_shard(_join(header, body), c)
    return craft


def _edit_skeleton(edit: Callable[[dict], Any] | None = None, raw: str | None = None) -> Callable[[Case], None]:
    def h(header: dict) -> None:
        meta = header["__metadata__"]
        if raw is not None:
            meta["slurmresume.skeleton"] = raw
        else:
            sk = json.loads(meta["slurmresume.skeleton"])
            edit(sk)  # type: ignore[misc]
            meta["slurmresume.skeleton"] = json.dumps(sk, separators=(",", ":"))
    return _edit_header(h)


class _Evil:
    """Unpickling this runs a command: the canary file appears if anyone unpickles it."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.canary}",))


def _pickle_bytes(c: Case) -> bytes:
    return pickle.dumps({"model": _Evil(c.outside / "PWNED")}, protocol=2)


def _link_to_outside(name: str, *, copy: bool = True) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        src = c.step2 / name
        decoy = c.outside / name
        if copy:
            shutil.copy(src, decoy)  # a perfectly valid file, just not inside the step dir
        src.unlink()
        src.symlink_to(decoy)
    return craft


def _fifo(name: str) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        p = c.step2 / name
        p.unlink(missing_ok=True)
        os.mkfifo(p)
    return craft


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _bomb_manifest(c: Case) -> None:
    """2 MiB of empty lists inside a free-form field: valid JSON, many times its size in RAM."""
    m = _manifest(c.step2)
    raw = json.dumps(m, separators=(",", ":")).encode()
    bomb = b"[" + b"[]," * (BOMB // 3) + b"[]]"
    raw = raw[:-1] + b',"zbomb":' + bomb + b"}"
    _write_manifest(c.step2, raw)


def _sparse_shard_claim(c: Case) -> None:
    """A 256 MiB sparse shard whose header claims one 256 MiB tensor (all offsets consistent):
    a reader must allocate what the file's apparent size allows, no more."""
    header, _ = _split((c.step2 / SHARD).read_bytes())
    size = 64 << 20
    h = {"__metadata__": header["__metadata__"], "big": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}
    raw = _join(h, b"")
    p = c.step2 / SHARD
    p.unlink()
    with open(p, "wb") as f:
        f.write(raw)
        f.truncate(len(raw) + size)
    import xxhash

    hasher = xxhash.xxh3_64()
    with open(p, "rb") as f:
        while chunk := f.read(8 << 20):
            hasher.update(chunk)

    def edit(m: dict) -> None:
        m["shards"][0]["bytes"] = len(raw) + size
        m["shards"][0]["xxh3"] = hasher.hexdigest()
    _edit_manifest(edit)(c)


def _shard_claims_tensor(shape: list[int], dtype: str = "F32") -> Callable[[Case], None]:
    def h(header: dict) -> None:
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = shape
        header[name]["dtype"] = dtype
    return _edit_header(h)


def _first_tensor(edit: Callable[[dict], Any]) -> Callable[[Case], None]:
    def h(header: dict) -> None:
        name = next(k for k in header if k != "__metadata__")
        edit(header[name])
    return _edit_header(h)


def _planted(name: str, content: Callable[[Case], bytes]) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        (c.step2 / name).write_bytes(content(c))
    return craft


def _step_dir_symlink(c: Case) -> None:
    """step_000000002 is a link to a complete checkpoint outside the root."""
    target = c.outside / "step_000000002"
    shutil.move(str(c.step2), target)
    c.step2.symlink_to(target, target_is_directory=True)


def _root_events(kind: str) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        p = c.root / "events.jsonl"
        p.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "symlink":
            p.symlink_to("/dev/zero")
        elif kind == "dir":
            p.mkdir()
    return craft


def _inprogress(kind: str) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        d = c.root / "step_000000003"
        d.mkdir()
        (d / SHARD).write_bytes(b"\0" * 64)
        p = d / ".inprogress"
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "symlink":
            (c.outside / "note").write_text('{"pid": 1, "host": "x"}')
            p.symlink_to(c.outside / "note")
        else:
            p.write_bytes(b"[" * 100000)
    return craft


def _lock(kind: str) -> Callable[[Case], None]:
    def craft(c: Case) -> None:
        p = c.root / ".slurmresume.lock"
        p.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(p)
        else:
            (c.outside / "victim").write_text("keep me")
            p.symlink_to(c.outside / "victim")
    return craft


# -- the corpus ---------------------------------------------------------------------------------

R, IGN, B, ROOT, U = "refused", "ignored", "bounded", "root", "unreadable"
PLAIN = "plain shard file name"

CASES: list[tuple[Case, Callable[[Case], None]]] = [
    # names in the manifest
    (Case("name-dotdot", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file=f"../../outside/{SHARD}"))),
    (Case("name-absolute", R, PLAIN), lambda c: _edit_manifest(
        lambda m: m["shards"][0].update(file=str(c.outside / SHARD)))(c)),
    (Case("name-subdir", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file=f"sub/{SHARD}"))),
    (Case("name-dot", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file="."))),
    (Case("name-nul", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file=SHARD + "\0.evil"))),
    (Case("name-newline", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file=SHARD + "\n"))),
    (Case("name-unicode-digits", R, PLAIN), _edit_manifest(
        lambda m: m["shards"][0].update(file="rank-\uff10\uff10\uff10\uff10\uff10-of-00001.safetensors"))),
    (Case("name-not-a-string", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file=["a", "b"]))),
    (Case("name-pickle-pt", R, PLAIN), _edit_manifest(lambda m: m["shards"][0].update(file="model.pt"))),
    # sizes and numbers in the manifest
    (Case("size-nan", R, "non-JSON literal NaN"), _raw_manifest(lambda raw: raw.replace(b'"bytes":', b'"bytes":NaN,"x":', 1))),
    (Case("size-infinity", R, "non-JSON literal"), _raw_manifest(lambda raw: raw.replace(b'"bytes":', b'"bytes":Infinity,"x":', 1))),
    (Case("size-1e400", R, "invalid size"), _raw_manifest(lambda raw: raw.replace(b'"bytes":', b'"bytes":1e400,"x":', 1))),
    (Case("size-negative", R, "invalid size"), _edit_manifest(lambda m: m["shards"][0].update(bytes=-1))),
    (Case("size-huge", R, "bytes"), _edit_manifest(lambda m: m["shards"][0].update(bytes=2**70))),
    (Case("size-string", R, "invalid size"), _edit_manifest(lambda m: m["shards"][0].update(bytes="100"))),
    (Case("size-bool", R, "invalid size"), _edit_manifest(lambda m: m["shards"][0].update(bytes=True))),
    (Case("world-huge", R, "expected"), _edit_manifest(lambda m: m.update(world_size=10**9))),
    (Case("step-mismatch", R, "does not match"), _edit_manifest(lambda m: m.update(step=1))),
    (Case("format-other", R, "format"), _edit_manifest(lambda m: m.update(format="otherformat/1"))),
    (Case("format-newer", U, "written by a newer slurmresume"),
     _edit_manifest(lambda m: m.update(format="slurmresume/999"))),
    # JSON structure
    (Case("json-duplicate-keys", R, "duplicate key"), _raw_manifest(lambda raw: b'{"shards":[],' + raw[1:])),
    (Case("json-deep-nesting", R, "nested too deeply"), _raw_manifest(
        lambda raw: raw[:-1] + b',"deep":' + _nested(200000).encode() + b"}")),
    (Case("json-oversized", U, "over this version's read cap"), lambda c: os.truncate(c.step2 / "manifest.json", (64 << 20) + 1)),
    (Case("json-not-utf8", R, "not valid JSON"), _raw_manifest(lambda raw: raw[:-1] + b',"x":"\xff\xfe"}')),
    (Case("json-not-object", R, "not a JSON object"), _raw_manifest(lambda raw: b"[" + raw + b"]")),
    (Case("json-bomb", B, max_growth=BASE_GROWTH + 100 * BOMB), _bomb_manifest),
    (Case("marker-oversized", U, "over this version's read cap"), lambda c: os.truncate(c.step2 / "COMMITTED", 1 << 20)),
    (Case("marker-nested", R, "nested too deeply"), lambda c: (c.step2 / "COMMITTED").write_bytes(_nested(2000).encode())),
    (Case("marker-other-step", R, "is for step"), lambda c: (c.step2 / "COMMITTED").write_bytes(
        __import__("slurmresume.checkpoint.manifest", fromlist=["x"]).marker_bytes(7, (c.step2 / "manifest.json").read_bytes()))),
    # files replaced by links, FIFOs, directories
    (Case("symlink-shard", R, "refusing shard"), _link_to_outside(SHARD)),
    (Case("symlink-manifest", R, "refusing manifest"), _link_to_outside("manifest.json")),
    (Case("symlink-marker", R, "refusing commit marker"), _link_to_outside("COMMITTED")),
    (Case("symlink-shard-dev-zero", R, "refusing shard"), lambda c: ((c.step2 / SHARD).unlink(), (c.step2 / SHARD).symlink_to("/dev/zero"))),
    (Case("symlink-step-dir", R, "not a real directory"), _step_dir_symlink),
    (Case("fifo-shard", R, "not a regular file"), _fifo(SHARD)),
    (Case("fifo-manifest", R, "not a regular file"), _fifo("manifest.json")),
    (Case("fifo-marker", R, "not a regular file"), _fifo("COMMITTED")),
    (Case("dir-shard", R, "not a regular file"), lambda c: ((c.step2 / SHARD).unlink(), (c.step2 / SHARD).mkdir())),
    # the safetensors header
    (Case("header-claims-2^62", R, "-byte header", load_time=True), lambda c: _replace_shard(
        struct.pack("<Q", 1 << 62) + (c.step2 / SHARD).read_bytes()[8:], c)),
    (Case("header-past-eof", R, "-byte header", load_time=True), lambda c: _replace_shard(
        struct.pack("<Q", 10**6) + (c.step2 / SHARD).read_bytes()[8:], c)),
    (Case("header-not-object", R, "not an object", load_time=True), lambda c: _replace_shard(
        _join(b"[1,2,3]", b""), c)),
    (Case("header-huge-shape", R, "offsets outside", load_time=True), _shard_claims_tensor([1 << 40, 1 << 20])),
    (Case("header-negative-shape", R, "bad dtype or shape", load_time=True), _shard_claims_tensor([-1, 4])),
    (Case("header-object-dtype", R, "bad dtype or shape", load_time=True), _shard_claims_tensor([4, 8], "O")),
    (Case("header-offsets-overlap", R, "offsets", load_time=True), _first_tensor(lambda t: t.update(data_offsets=[0, 10**9]))),
    (Case("header-offsets-negative", R, "data_offsets", load_time=True), _first_tensor(lambda t: t.update(data_offsets=[-8, 0]))),
    (Case("header-sparse-64MiB-claim", B, max_growth=BASE_GROWTH + (64 << 20)), _sparse_shard_claim),
    # the JSON skeleton inside the shard
    (Case("skeleton-object-ndarray", R, "object arrays are refused", load_time=True), _edit_skeleton(
        lambda sk: sk["entries"]["extra"].update(value={"__ndarray__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}))),
    (Case("skeleton-object-scalar", R, "object scalars are refused", load_time=True), _edit_skeleton(
        lambda sk: sk["entries"]["extra"].update(value={"__npscalar__": ["|O", 1]}))),
    (Case("skeleton-missing-tensor", R, "lacks", load_time=True), _edit_skeleton(
        lambda sk: sk["entries"]["extra"].update(value={"__tensor__": "../../etc/passwd"}))),
    (Case("skeleton-deep", R, "nested too deeply", load_time=True), _edit_skeleton(raw=_nested(100000))),
    (Case("skeleton-deep-990", R, "nested too deeply", load_time=True), _edit_skeleton(
        raw='{"entries":{"extra":{"kind":"value","value":' + _nested(990) + '}}}')),
    (Case("skeleton-not-json", R, "not valid JSON", load_time=True), _edit_skeleton(raw="\x80\x02cos\nsystem\n")),
    (Case("skeleton-malformed", R, "skeleton", load_time=True), _edit_skeleton(raw='{"entries":[1,2]}')),
    # pickles
    (Case("pickle-as-shard", R, "header", load_time=True), lambda c: _replace_shard(_pickle_bytes(c), c)),
    (Case("pickle-stray-x.pt", IGN), _planted("x.pt", _pickle_bytes)),
    (Case("pickle-stray-bin", IGN), _planted("pytorch_model.bin", _pickle_bytes)),
    (Case("pickle-stray-metadata", IGN), _planted(".metadata", _pickle_bytes)),
    # hostile roots
    (Case("root-events-fifo", ROOT), _root_events("fifo")),
    (Case("root-events-symlink-dev-zero", ROOT), _root_events("symlink")),
    (Case("root-events-directory", ROOT), _root_events("dir")),
    (Case("root-inprogress-fifo", ROOT), _inprogress("fifo")),
    (Case("root-inprogress-symlink", ROOT), _inprogress("symlink")),
    (Case("root-inprogress-deep-json", ROOT), _inprogress("deep")),
    (Case("root-lock-fifo", ROOT), _lock("fifo")),
    (Case("root-lock-symlink", ROOT), _lock("symlink")),
]


def pristine(base: Path) -> Path:
    """A root with steps 1 and 2 committed (tiny model + plain values), built once."""
    from helpers.core import save_steps

    root = base / "_pristine"
    if not (root / "step_000000002" / "COMMITTED").exists():
        shutil.rmtree(root, ignore_errors=True)
        save_steps(root, [1, 2]).close()
    return root


def build(base: Path, names: list[str] | None = None) -> list[Case]:
    """Build every case (or those named) under `base`/<case>/{root,outside}."""
    base = Path(base)
    src = pristine(base)
    out = []
    for proto, craft in CASES:
        if names is not None and proto.name not in names:
            continue
        c = Case(**{k: getattr(proto, k) for k in ("name", "expect", "message", "load_time", "max_growth")})
        where = base / c.name
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        c.root, c.outside = where / "root", where / "outside"
        shutil.copytree(src, c.root, symlinks=True)
        (c.root / "events.jsonl").unlink(missing_ok=True)
        c.outside.mkdir()
        craft(c)
        out.append(c)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    for c in build(Path(argv[0])):
        print(f"{c.expect:8} {c.name:32} {c.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
