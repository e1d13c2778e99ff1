// Types for onceq-guest.js, for editors and for TypeScript handlers
// (type-check with `tsc --allowJs --checkJs --noEmit`; build the emitted
// JavaScript with componentize-js).

/** A value that can be written to a column. */
export type ColumnValue =
  | null
  | undefined
  | boolean
  | number
  | bigint
  | string
  | Uint8Array
  | Date
  | Timestamp
  | Float64
  | Json;

/**
 * A row as read: column name → value. int64 and timestamp columns are
 * numbers (bigint past 2^53), text is a string, bytes a Uint8Array, JSON
 * its text, NULL is null. Typed `any` so that ordinary JavaScript reads it
 * as it would a parsed JSON object; the host checks types on write.
 */
export type Row = Record<string, any>;

/**
 * The database's tables, filled in by a generated `schema.d.ts` (`onceq
 * types --lang ts`): table name → its row, write and key types. Left empty,
 * any table name and column is accepted (the host checks them at run time).
 */
// eslint-disable-next-line @typescript-eslint/no-empty-object-type
export interface Tables {}

/** A table's name: one of `Tables` once generated, else any string. */
export type TableName = [keyof Tables] extends [never] ? string : keyof Tables & string;

/** Part `K` of table `N`'s generated types, or `Else` without them. */
export type TableType<N, K extends string, Else> = N extends keyof Tables
  ? Tables[N] extends { [P in K]: infer T }
    ? T
    : Else
  : Else;

/** Dead-letter the message now, with this reason. */
export class Reject extends Error {}

/** Retry later (counts as an attempt), optionally after `delayMs`. */
export class Retry extends Error {
  constructor(reason: string, delayMs?: number);
  delayMs?: number;
}

export function reject(reason: string): never;
export function retry(reason: string, delayMs?: number): never;

/** A timestamp column value, microseconds since the Unix epoch. */
export class Timestamp {
  constructor(micros: number | bigint);
  readonly micros: bigint;
}

/** A float64 column value (a number with no fraction is otherwise int64). */
export class Float64 {
  constructor(x: number);
  readonly value: number;
}

/** A JSON column value. */
export class Json {
  constructor(v: unknown);
  readonly value: unknown;
}

/** Compact JSON with sorted keys (the bytes follow-ups and intents carry). */
export function stableJson(v: unknown): string;

/** The message being handled. */
export class Message {
  readonly id: string;
  readonly queue: string;
  readonly payload: Uint8Array;
  readonly attributes: Record<string, string>;
  /** 1 on the first delivery. */
  readonly attempt: number;
  /** Microseconds since the Unix epoch (database time). */
  readonly enqueuedAt: number;
  /** The message's logical time, microseconds; `Date.now()` reads it too. */
  readonly now: number;
  readonly seed: bigint;
  /** The payload as text. */
  text(): string;
  /** The payload parsed as JSON; a malformed payload rejects the message. */
  json(): any;
  /** The named fields of a JSON-object payload, in order; a missing one rejects the message. */
  fields(...names: string[]): any[];
}

export interface EnqueueOptions {
  delayMs?: number;
  dedupKey?: string;
  attributes?: Record<string, string>;
}

/** What a handler reads and emits. */
export class Ctx {
  /** One row by primary key (values in key column order), or null. */
  get<N extends TableName>(table: N, key: TableType<N, 'key', ColumnValue[]>): TableType<N, 'row', Row> | null;
  /** Rows whose key starts with `prefix`, in key order, at most `limit`. */
  scan<N extends TableName>(table: N, prefix: TableType<N, 'prefix', ColumnValue[]>, limit: number): TableType<N, 'row', Row>[];
  /** A new row: every NOT NULL column. */
  insert<N extends TableName>(table: N, columns: TableType<N, 'insert', Record<string, ColumnValue>>): void;
  /** Columns of an existing row, found by its key columns. */
  update<N extends TableName>(table: N, columns: TableType<N, 'update', Record<string, ColumnValue>>): void;
  /** Insert, or replace the row with this key. */
  upsert<N extends TableName>(table: N, columns: TableType<N, 'insert', Record<string, ColumnValue>>): void;
  /** Delete the row with these key columns. */
  delete<N extends TableName>(table: N, key: TableType<N, 'keyColumns', Record<string, ColumnValue>>): void;
  /** A follow-up message (JSON payload), enqueued with the ack. */
  enqueue(queue: string, payload: unknown, options?: EnqueueOptions): void;
  /** Ack now and continue later: `state` on this queue after `delayMs`. */
  reschedule(msg: Message, delayMs: number, state: unknown): void;
  /** An external side effect, delivered after commit with `key`. */
  intent(connector: string, key: string, payload: unknown, metadata?: Record<string, string>): void;
  log(message: string, level?: 'trace' | 'debug' | 'info' | 'warn' | 'error'): void;
}

/** The export a handler module gives as `handler`. */
export interface HandlerExport {
  handle(msg: unknown): unknown;
}

/** The `handler` export for a handler function. */
export function defineHandler(handle: (ctx: Ctx, msg: Message) => void): HandlerExport;
