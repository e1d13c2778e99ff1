"""onceq-guest for Python: write onceq message handlers in Python.

A handler is a function taking a `Ctx` and a `Message`; it reads rows
through the ctx (served from the message's transaction) and *describes*
what should happen: row writes, follow-up messages and external intents.
The host applies them together with the message's ack, in one
transaction, or none of them. Export it with `export(handler)`:

    from onceq_guest import export, reject

    def handle(ctx, msg):
        order = msg.json()
        ...

    Handler = export(handle)

Build with `componentize-py -d wit -w queue-handler componentize app
--stub-wasi -o app.wasm` (see the Makefile's `guests-python`).

Determinism: `--stub-wasi` leaves the component no clock and no entropy
(calling them would trap), so this module gives ordinary code the
message's own: during a call, `time.time()` / `time.time_ns()` read the
message's logical time, `time.monotonic()` / `perf_counter()` stand still,
and the `random` module and `os.urandom()` (hence `uuid.uuid4()`) are
seeded from the message id. A re-run of the same message sees the same
values. (`datetime.now()` reads the C clock directly and traps: use
`datetime.fromtimestamp(time.time(), timezone.utc)`.)
"""

import builtins as _builtins
import json
import os as _os
import random as _random
import time as _time

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import log as _log
from wit_world.imports import store as _store
from wit_world.imports import types as t


class Reject(Exception):
    """Dead-letter the message now, with this reason."""


class Retry(Exception):
    """Retry later (counts as an attempt), optionally after delay_ms."""

    def __init__(self, reason, delay_ms=None):
        super().__init__(reason)
        self.delay_ms = delay_ms


def reject(reason):
    raise Reject(reason)


def value(v):
    """A Python value as a WIT value (None, bool, int, float, str, bytes,
    Timestamp, Json)."""
    if v is None:
        return t.Value_Null()
    if isinstance(v, bool):
        return t.Value_Boolean(v)
    if isinstance(v, int):
        return t.Value_Int64(v)
    if isinstance(v, float):
        return t.Value_Float64(v)
    if isinstance(v, str):
        return t.Value_Text(v)
    if isinstance(v, (bytes, bytearray)):
        return t.Value_Bytes(bytes(v))
    if isinstance(v, Timestamp):
        return t.Value_Timestamp(v.micros)
    if isinstance(v, Json):
        return t.Value_Json(_json_bytes(v.value).decode())
    raise TypeError(f"cannot store a {type(v).__name__}; wrap JSON in Json(...)")


class Json:
    """A JSON column value: any JSON-serialisable value."""

    def __init__(self, value):
        self.value = value


def _json_bytes(v):
    """Compact JSON with sorted keys: the same bytes as the Rust and
    JavaScript SDKs write."""
    return json.dumps(v, separators=(",", ":"), sort_keys=True).encode()


def _pairs(d):
    return list(d.items()) if isinstance(d, dict) else list(d)


class Timestamp:
    """A timestamp column value, microseconds since the Unix epoch."""

    def __init__(self, micros):
        self.micros = micros


def _plain(v):
    return None if isinstance(v, t.Value_Null) else v.value


def _row(columns):
    """A row the store returned, as a dict of plain values."""
    return {c.name: _plain(c.value) for c in columns}


class Message:
    def __init__(self, m):
        self.id = m.id
        self.queue = m.queue
        self.payload = m.payload
        self.attributes = dict(m.attributes)
        self.attempt = m.attempt
        self.enqueued_at = m.enqueued_at
        self.now = m.now
        self.seed = m.seed

    def json(self):
        try:
            return json.loads(self.payload)
        except Exception as e:
            raise Reject(f"malformed payload: {e}")

    def fields(self, *names):
        """The named fields of a JSON-object payload, in order; a payload
        that is not an object, or lacks one of them, rejects the message
        (as a Rust handler's typed payload does)."""
        v = self.json()
        if not isinstance(v, dict):
            raise Reject("malformed payload: expected an object")
        missing = [n for n in names if n not in v]
        if missing:
            raise Reject(f"malformed payload: missing field `{missing[0]}`")
        return [v[n] for n in names]


def _no_files(file=None, *_args, **_kwargs):
    raise OSError(
        f"open({file!r}) is not available in onceq's sandbox (no files): "
        "read rows with ctx.get/scan, keep data in the tables of schema.sql"
    )


# The sandbox has no files: without this, open() ends the instance with a
# bare "unreachable" trap and no line; with it, an exception the handler
# may catch, or a crash whose reason names the line that called it.
_builtins.open = _no_files


class _Table:
    """One table's reads and writes: see `Ctx.tables`."""

    def __init__(self, ctx, name):
        self._ctx, self._name = ctx, name

    def get(self, key):
        return self._ctx.get(self._name, key)

    def scan(self, prefix, limit):
        return self._ctx.scan(self._name, prefix, limit)

    def insert(self, **cols):
        self._ctx.insert(self._name, **cols)

    def update(self, **cols):
        self._ctx.update(self._name, **cols)

    def upsert(self, **cols):
        self._ctx.upsert(self._name, **cols)

    def delete(self, **key):
        self._ctx.delete(self._name, **key)


class _Tables:
    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Table(self._ctx, name)

    def __getitem__(self, name):
        return _Table(self._ctx, name)


class Ctx:
    def __init__(self):
        self.effects = []

    def get(self, table, key):
        """One row by primary key, as a dict, or None."""
        try:
            row = _store.get(table, [value(k) for k in key])
        except Err as e:
            raise Retry(f"read of {table} failed: {e.value}")
        return None if row is None else _row(row)

    def scan(self, table, prefix, limit):
        try:
            rows = _store.scan(table, [value(k) for k in prefix], limit)
        except Err as e:
            raise Retry(f"scan of {table} failed: {e.value}")
        return [_row(r) for r in rows]

    def _write(self, table, op, cols):
        columns = [t.Column(k, value(v)) for k, v in cols.items()]
        self.effects.append(t.Effect_Write(t.RowWrite(table, op, columns)))

    def insert(self, table, **cols):
        self._write(table, t.WriteOp.INSERT, cols)

    @property
    def tables(self):
        """The tables by name: `ctx.tables.points.upsert(id=..., n=...)` is
        `ctx.upsert("points", id=..., n=...)`. With `schema_types.pyi`
        (`onceq types --lang py`), mypy names a wrong table ("has no
        attribute"), column ("Unexpected keyword argument") or value type
        ("incompatible type ...; expected ...") exactly."""
        return _Tables(self)

    def update(self, table, **cols):
        self._write(table, t.WriteOp.UPDATE, cols)

    def upsert(self, table, **cols):
        self._write(table, t.WriteOp.UPSERT, cols)

    def delete(self, table, **key):
        self._write(table, t.WriteOp.DELETE, key)

    def enqueue(self, queue, payload, delay_ms=None, dedup_key=None, attributes=()):
        """A follow-up message (JSON payload), enqueued with the ack;
        `attributes` a dict or (name, value) pairs."""
        follow_up = t.FollowUp(queue, _json_bytes(payload), _pairs(attributes), delay_ms, dedup_key)
        self.effects.append(t.Effect_Enqueue(follow_up))

    def reschedule(self, msg, delay_ms, state):
        """Ack now and continue later: `state` on this queue after delay_ms."""
        self.enqueue(msg.queue, state, delay_ms=delay_ms)

    def intent(self, connector, key, payload, metadata=()):
        """An external side effect, delivered after commit with `key`."""
        intent = t.ExternalIntent(connector, key, _json_bytes(payload), _pairs(metadata))
        self.effects.append(t.Effect_Intent(intent))

    def log(self, message, level="info"):
        """A line in the message's log; level: trace, debug, info, warn, error."""
        if isinstance(level, str):
            level = _LEVELS.get(level, _log.Level.INFO)
        _log.log(level, str(message))


_LEVELS = {
    "trace": _log.Level.TRACE,
    "debug": _log.Level.DEBUG,
    "info": _log.Level.INFO,
    "warn": _log.Level.WARN,
    "error": _log.Level.ERROR,
}

_now_us = 0


def _time_time():
    return _now_us / 1_000_000


def _time_time_ns():
    return _now_us * 1000


def _still():
    return 0.0


def _still_ns():
    return 0


def _urandom(n):
    return _random.randbytes(n)


_time.time = _time_time
_time.time_ns = _time_time_ns
_time.monotonic = _time.perf_counter = _still
_time.monotonic_ns = _time.perf_counter_ns = _still_ns
_os.urandom = _urandom


def _project_path(filename):
    """A source path as the project names it: componentize-py files each
    source folder under a number (`/0/app.py`), which is dropped."""
    parts = filename.split("/")
    if len(parts) > 2 and parts[0] == "" and parts[1].isdigit():
        return "/".join(parts[2:])
    return filename


def _describe(e):
    """The exception and its frames, without reading source files (there
    is no filesystem)."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = _project_path(code.co_filename)
        # The SDK's own frame (the call into the handler) is not the bug.
        if path != "onceq_guest.py":
            frames.append(f"  {path}:{tb.tb_lineno} in {code.co_name}")
        tb = tb.tb_next
    return "\n".join([f"{type(e).__name__}: {e}"] + frames)


def _run(handle, m):
    """One message through `handle`: its effects, or the WIT error."""
    global _now_us
    _now_us = m.now
    _random.seed(m.seed)
    ctx = Ctx()
    try:
        handle(ctx, Message(m))
    except Reject as e:
        raise Err(t.HandlerError_Reject(str(e)))
    except Retry as e:
        raise Err(t.HandlerError_Retry(t.RetryLater(str(e), e.delay_ms)))
    except Exception as e:
        # A bug: reported as a crash naming it (the host reads a retry
        # whose reason starts "uncaught " as one), instead of a bare trap;
        # dead-lettered at once unless the queue sets retry_crashes.
        raise Err(t.HandlerError_Retry(t.RetryLater(f"uncaught {_describe(e)}", None)))
    return ctx.effects


def _warm(ctx, msg):
    """What a handler does with the SDK, without the store."""
    a, b, c = msg.fields("order_id", "account", "amount")
    _row([t.Column("id", t.Value_Text(a)), t.Column("n", t.Value_Int64(c)), t.Column("z", t.Value_Null())])
    now = Timestamp(msg.now)
    ctx.insert("t", id=a, n=c, f=1.5, ok=True, blob=b"x", at=now, doc=Json({"k": [1]}), none=None)
    ctx.update("t", id=a, n=c - 1, at=now)
    ctx.upsert("t", id=a, n=c)
    ctx.delete("t", id=a)
    ctx.enqueue("q", {"order_id": a}, delay_ms=1, dedup_key="k", attributes={"x": "y"})
    ctx.intent("c", f"k-{a}", {"order_id": a, "account": b, "amount": c}, metadata={"m": "v"})
    try:
        msg.fields("missing")
    except Reject:
        pass


def _warm_up():
    """Run the SDK's own per-message code a few times while the component
    is built. componentize-py snapshots the interpreter after the modules
    ran, and every message starts from that snapshot in a fresh instance:
    CPython's specialised bytecode, attribute caches and type versions
    made here are not made again by every message (a payments message ran
    795,000 instructions before, 601,000 after; docs/src/benchmarks.md).
    Only the SDK runs: no handler, no store, no host call. What it sets is
    put back (the clock, the random state), and `_run` sets both from each
    message anyway."""
    global _now_us
    payload = b'{"order_id": "o-1", "account": "a-1", "amount": 5}'
    state = _random.getstate()
    for i in range(8):
        _run(_warm, t.Message("m", "q", payload, [("k", "v")], 1, 0, i, i))
    _random.setstate(state)
    _now_us = 0


def export(handle):
    """The component's export class for a handler function. An exception
    other than `Reject`/`Retry` is a crash whose reason names it (a retry
    whose reason starts "uncaught ", which the host reads as a crash)."""

    class Handler(exports.Handler):
        def handle(self, m):
            return _run(handle, m)

    return Handler


_warm_up()
