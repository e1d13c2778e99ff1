// onceq-guest for JavaScript: write onceq message handlers in JavaScript.
//
// A handler is a function taking a `Ctx` and a `Message`; it reads rows
// through the ctx (served from the message's transaction) and *describes*
// what should happen: row writes, follow-up messages and external intents.
// The host applies them together with the message's ack, in one
// transaction, or none of them. Export it as the `handler` interface:
//
//     import { defineHandler, reject } from '../onceq-guest.js';
//
//     export const handler = defineHandler((ctx, msg) => {
//       const order = msg.json();
//       ...
//     });
//
// Build with componentize-js (see the Makefile's `guests-js`):
//
//     componentize-js app.js --wit wit -n queue-handler \
//         -d stdio http fetch-event -o app.wasm
//
// `-d stdio http fetch-event` leaves only the deterministic WASI the host
// provides: `Date.now()` reads the message's logical time and
// `Math.random()` / `crypto.getRandomValues()` are seeded from the message
// id, so a re-run of the same message gives the same effects. `console.*`
// goes to the message's log.

import { log as hostLog } from 'onceq:handler/log@0.1.0';
import { emit as hostEmit, get as hostGet, scan as hostScan } from 'onceq:handler/encoded@0.1.0';

// Reads and effects cross to the host as JSON in UTF-8 bytes (the WIT's
// `encoded` interface), not as typed records or strings: the bindings
// componentize-js generates lower every field of a record, and measure
// every string character by character, in interpreted code (about 3,600
// instructions a character). Native JSON.stringify, TextEncoder and one
// copy of the bytes do the same work for a fraction (docs/src/benchmarks.md).
// The encoding is the WIT's: a value is null, a boolean, a string, a safe
// integer, or an object naming its type.

/** Dead-letter the message now, with this reason. */
export class Reject extends Error {}

/** Retry later (counts as an attempt), optionally after `delayMs`. */
export class Retry extends Error {
  constructor(reason, delayMs) {
    super(reason);
    this.delayMs = delayMs;
  }
}

export function reject(reason) {
  throw new Reject(reason);
}

export function retry(reason, delayMs) {
  throw new Retry(reason, delayMs);
}

/** A timestamp column value, microseconds since the Unix epoch. */
export class Timestamp {
  constructor(micros) {
    this.micros = BigInt(micros);
  }
}

/** A float64 column value (a JS number with no fraction is stored as int64). */
export class Float64 {
  constructor(x) {
    this.value = Number(x);
  }
}

/** A JSON column value: any JSON-serialisable value. */
export class Json {
  constructor(v) {
    this.value = v;
  }
}

// The SDK's own loops index arrays (an object's through Object.keys): in a
// fresh instance SpiderMonkey's interpreter spends about 20,000
// instructions on each step of a for-of over an array (its iterator is
// self-hosted code), about 6,000 on each callback of map(), about 2,000 on
// a step of an indexed loop; a JSON.stringify replacer made stableJson
// cost 153,000 for a three-key payload. Measured with `onceq try`
// (docs/src/handlers/javascript.md).

/** A copy of `x` with every object's keys in sorted order, BigInts as numbers. */
function sortedCopy(x) {
  if (x === null || typeof x !== 'object') return typeof x === 'bigint' ? Number(x) : x;
  if (typeof x.toJSON === 'function') return sortedCopy(x.toJSON());
  if (x instanceof Uint8Array) return x;
  if (Array.isArray(x)) {
    const a = new Array(x.length);
    for (let i = 0; i < x.length; i++) a[i] = sortedCopy(x[i]);
    return a;
  }
  const keys = Object.keys(x).sort();
  const o = {};
  for (let i = 0; i < keys.length; i++) o[keys[i]] = sortedCopy(x[keys[i]]);
  return o;
}

/**
 * Compact JSON with object keys sorted, so the same value always gives the
 * same bytes (and the same bytes as the Rust and Python SDKs).
 */
export function stableJson(v) {
  return JSON.stringify(sortedCopy(v));
}

/**
 * An object's own enumerable string-keyed properties as [key, value]
 * pairs (what Object.entries gives), each value through `map` if given.
 */
function pairs(o, map) {
  const keys = Object.keys(o);
  const out = new Array(keys.length);
  for (let i = 0; i < keys.length; i++) out[i] = [keys[i], map ? map(o[keys[i]]) : o[keys[i]]];
  return out;
}

/** Values in the encoding of the WIT's `encoded` interface. */
function encodeAll(values) {
  const out = new Array(values.length);
  for (let i = 0; i < values.length; i++) out[i] = encode(values[i]);
  return out;
}

const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);

/** A float64 as the encoding writes it: JSON has no NaN or infinities. */
function float(x) {
  return Number.isFinite(x) ? x : String(x);
}

/** A JavaScript value in the encoding of the WIT's `encoded` interface. */
function encode(v) {
  if (v === null || v === undefined) return null;
  switch (typeof v) {
    case 'boolean':
    case 'string':
      return v;
    case 'number':
      if (Number.isSafeInteger(v)) return v;
      return Number.isInteger(v) ? { int64: BigInt(v).toString() } : { float64: float(v) };
    case 'bigint':
      return v >= -MAX_SAFE && v <= MAX_SAFE ? Number(v) : { int64: v.toString() };
  }
  if (v instanceof Uint8Array) return { bytes: Array.from(v) };
  if (v instanceof Timestamp) return { timestamp: v.micros.toString() };
  if (v instanceof Float64) return { float64: float(v.value) };
  if (v instanceof Json) return { json: stableJson(v.value) };
  if (v instanceof Date) return { timestamp: (BigInt(v.getTime()) * 1000n).toString() };
  throw new TypeError(`cannot store a ${v?.constructor?.name ?? typeof v}; wrap JSON in new Json(...)`);
}

/** An encoded value the host tagged with its type, as a plain JavaScript value. */
function decodeTagged(v) {
  if ('int64' in v) return BigInt(v.int64);
  if ('timestamp' in v) return typeof v.timestamp === 'string' ? BigInt(v.timestamp) : v.timestamp;
  if ('float64' in v) return Number(v.float64);
  if ('json' in v) return v.json;
  if ('bytes' in v) return Uint8Array.from(v.bytes);
  return v.text;
}

/**
 * A row as the host encodes it, as an object of plain values: int64 and
 * timestamps as numbers when safe (else BigInt), JSON columns as text.
 */
function decodeRow(row) {
  for (const k in row) {
    const v = row[k];
    if (v !== null && typeof v === 'object') row[k] = decodeTagged(v);
  }
  return row;
}

function plainInt(n) {
  const x = Number(n);
  return Number.isSafeInteger(x) ? x : n;
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** The message being handled. */
export class Message {
  constructor(m) {
    this.id = m.id;
    this.queue = m.queue;
    this.payload = m.payload;
    this.attributes = {};
    for (let i = 0; i < m.attributes.length; i++) this.attributes[m.attributes[i][0]] = m.attributes[i][1];
    this.attempt = m.attempt;
    this.enqueuedAt = plainInt(m.enqueuedAt);
    this.now = plainInt(m.now);
    this.seed = m.seed;
  }

  /** The payload as text. */
  text() {
    return decoder.decode(this.payload);
  }

  /** The payload parsed as JSON; a malformed payload rejects the message. */
  json() {
    try {
      return JSON.parse(this.text());
    } catch (e) {
      throw new Reject(`malformed payload: ${e.message}`);
    }
  }

  /**
   * The named fields of a JSON-object payload, in order; a payload that is
   * not an object, or lacks one of them, rejects the message (as a Rust
   * handler's typed payload does).
   */
  fields(...names) {
    const v = this.json();
    if (typeof v !== 'object' || v === null || Array.isArray(v)) {
      throw new Reject('malformed payload: expected an object');
    }
    const out = new Array(names.length);
    for (let i = 0; i < names.length; i++) {
      if (!(names[i] in v)) throw new Reject(`malformed payload: missing field \`${names[i]}\``);
      out[i] = v[names[i]];
    }
    return out;
  }
}

function hostError(e) {
  return e && typeof e === 'object' && 'payload' in e ? e.payload : String(e);
}

/** What a handler reads and emits. */
export class Ctx {
  constructor() {
    this.effects = [];
  }

  /** One row by primary key (values in key column order), as an object, or null. */
  get(table, key) {
    let row;
    try {
      row = hostGet(encoder.encode(JSON.stringify({ table, key: encodeAll(key) })));
    } catch (e) {
      throw new Retry(`read of ${table} failed: ${hostError(e)}`);
    }
    return row === undefined || row === null ? null : decodeRow(JSON.parse(row));
  }

  /** Rows whose key starts with `prefix`, in key order, at most `limit`. */
  scan(table, prefix, limit) {
    let rows;
    try {
      rows = hostScan(encoder.encode(JSON.stringify({ table, prefix: encodeAll(prefix), limit })));
    } catch (e) {
      throw new Retry(`scan of ${table} failed: ${hostError(e)}`);
    }
    const out = JSON.parse(rows);
    for (let i = 0; i < out.length; i++) decodeRow(out[i]);
    return out;
  }

  #write(table, op, cols) {
    this.effects.push({ write: { table, op, columns: pairs(cols, encode) } });
  }

  /** Create a row; the attempt fails if the key exists. */
  insert(table, cols) {
    this.#write(table, 'insert', cols);
  }

  /** Change the given columns of an existing row. */
  update(table, cols) {
    this.#write(table, 'update', cols);
  }

  /** Insert, or update the given columns if the key exists. */
  upsert(table, cols) {
    this.#write(table, 'upsert', cols);
  }

  /** Delete a row by key (give only the primary-key columns). */
  delete(table, key) {
    this.#write(table, 'delete', key);
  }

  /** A follow-up message (JSON payload), enqueued with the ack. */
  enqueue(queue, payload, { delayMs, dedupKey, attributes = {} } = {}) {
    this.effects.push({
      enqueue: {
        queue,
        payload: stableJson(payload),
        attributes: pairs(attributes),
        'delay-ms': delayMs,
        'dedup-key': dedupKey,
      },
    });
  }

  /** Ack now and continue later: `state` on this queue after `delayMs`. */
  reschedule(msg, delayMs, state) {
    this.enqueue(msg.queue, state, { delayMs });
  }

  /** An external side effect, delivered after commit with `key`. */
  intent(connector, key, payload, metadata = {}) {
    this.effects.push({
      intent: {
        connector,
        'idempotency-key': key,
        payload: stableJson(payload),
        metadata: pairs(metadata),
      },
    });
  }

  /** A line in the message's log. */
  log(message, level = 'info') {
    hostLog(level, String(message));
  }
}

function describe(e) {
  if (e instanceof Error) return `${e.name}: ${e.message}${e.stack ? `\n${projectStack(e.stack)}` : ''}`;
  return String(e);
}

// A stack as the project names its files: the folder the builder copied
// the sources to (a temporary one) is dropped, and so are the SDK's frames.
function projectStack(stack) {
  return stack
    .split('\n')
    .filter((l) => !l.includes('onceq-guest.js'))
    .map((l) => l.replace(/(?:file:\/\/)?\/[^\s@()]*\/([^\/\s@():]+\.js)/g, '$1'))
    .join('\n');
}

// The sandbox has no network: without this, fetch() ends the instance with
// a bare "unreachable" trap and no line; with it, an exception the handler
// may catch, or a crash whose reason names the line that called it.
/** @param {unknown} resource */
globalThis.fetch = function fetch(resource) {
  throw new Error(
    `fetch(${JSON.stringify(String(resource))}) is not available in onceq's sandbox (no network): ` +
      'emit ctx.intent(connector, key, payload), delivered through the outbox after the commit',
  );
};

const line = (level) => (...args) =>
  hostLog(level, args.map((a) => (typeof a === 'string' ? a : describe(a))).join(' '));
globalThis.console = {
  ...globalThis.console,
  log: line('info'),
  info: line('info'),
  debug: line('debug'),
  warn: line('warn'),
  error: line('error'),
};

/**
 * The `handler` export for a handler function. An exception other than
 * `Reject`/`Retry` is a crash whose reason names it (a retry whose reason
 * starts "uncaught ", which the host reads as a crash), so a bug shows up
 * in the dead letter readable instead of as a bare trap.
 */
export function defineHandler(handle) {
  return {
    handle(m) {
      const ctx = new Ctx();
      try {
        handle(ctx, new Message(m));
      } catch (e) {
        if (e instanceof Reject) throw { tag: 'reject', val: e.message };
        if (e instanceof Retry) {
          const delayMs = e.delayMs === undefined ? undefined : BigInt(e.delayMs);
          throw { tag: 'retry', val: { reason: e.message, delayMs } };
        }
        throw { tag: 'retry', val: { reason: `uncaught ${describe(e)}`, delayMs: undefined } };
      }
      // All effects in one emit; the host keeps a refusal and fails the
      // attempt with it, whatever is returned here.
      if (ctx.effects.length > 0) {
        try {
          hostEmit(encoder.encode(JSON.stringify(ctx.effects)));
        } catch (e) {
          throw { tag: 'reject', val: hostError(e) };
        }
      }
      return [];
    },
  };
}

// Warm-up, run once when the component is built. componentize-js
// snapshots the engine after this module ran, and every message starts
// from that snapshot in a fresh instance. SpiderMonkey makes a builtin
// (Promise and async functions, BigInt, DataView, the iterators...) the
// first time a global's code uses it, and copies a self-hosted function
// into a global on its first call. Left to the messages, every instance
// would make the same ones again: without this, an empty handler ran 1.1
// million instructions a message, 0.42 million with it
// (docs/src/benchmarks.md). Only builtins and the SDK's pure helpers run
// here: the host's imports are not there at build time.
(function warmUp() {
  const parsed = JSON.parse(JSON.stringify({ a: [1, 'x', null, true], b: { c: 2.5 } }));
  for (const _ of new Map([[0, parsed]]));
  Object.fromEntries(Object.entries(parsed).map(([k, v]) => [k, v]));
  Object.keys(parsed).sort();
  `${'x'.split('\n').map((l) => l.replace(/a/g, 'b')).filter((l) => !l.includes('y')).join('\n')}`;
  decoder.decode(encoder.encode('x'));
  void new Error('x').stack;
  stableJson({ b: [1, { d: 1 }], a: 'x' });
  const values = [1, 2n ** 60n, 1.5, NaN, 'x', true, null, new Uint8Array(1), new Timestamp(1), new Float64(1), new Json({ a: 1 }), new Date(0)];
  const row = {};
  for (const [i, v] of values.entries()) row[`c${i}`] = v;
  JSON.stringify([{ write: { table: 't', op: 'insert', columns: pairs(row, encode) } }]);
  pairs({ a: 'b' });
  JSON.stringify({ table: 't', key: encodeAll([1, 'x']) });
  decodeRow(JSON.parse(JSON.stringify({ a: 1, b: { int64: '1' }, c: { timestamp: 1 }, d: { float64: 'NaN' }, e: { json: '{}' }, f: { bytes: [1] } })));

  // The bindings componentize-js generates run in a global of their own,
  // where the imports are made: they decode the message and call the
  // handler from an async function, then encode the effects with BigInt,
  // DataView and Uint8Array of that global. Warmed through that global's
  // Function constructor. If a later componentize-js lays its bindings out
  // otherwise, they stay cold and nothing else changes.
  try {
    const bindings = hostLog.constructor('return this')();
    if (bindings === globalThis || typeof bindings?.eval !== 'function') return;
    bindings.eval(`(() => {
      const dv = new DataView(new ArrayBuffer(64));
      dv.setUint32(0, 1, true); dv.getUint32(0, true); dv.setInt8(4, 0, true);
      dv.setBigInt64(8, 1n, true); dv.getBigInt64(8, true); dv.setFloat64(16, 1.5, true);
      const bytes = new Uint8Array(dv.buffer.slice(0, 8));
      const m = new Map([[1, bytes]]); m.get(1); m.delete(1);
      BigInt.asUintN(64, BigInt(1)); BigInt.asIntN(64, BigInt(-1));
      const list = []; for (let i = 0; i < 2; i++) list.push([String(i), 'x']);
      for (const e of list) void e;
      try { throw new TypeError('x'); } catch (e) { void (e instanceof TypeError); }
      void (async () => ({ tag: 'ok', val: list }))();
      void (async () => { await 0; return list; })();
    })()`);
  } catch {
    // Left cold: slower, not wrong.
  }
})();
