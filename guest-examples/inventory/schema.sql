-- Business tables of the inventory example (SQLite DDL, applied by `onceq init`).
CREATE TABLE IF NOT EXISTS items (
    sku TEXT PRIMARY KEY,
    stock INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS reservations (
    order_id TEXT PRIMARY KEY,
    sku TEXT NOT NULL,
    qty INTEGER NOT NULL,
    status TEXT NOT NULL
);
