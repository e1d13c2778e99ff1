-- Business tables of the report example (SQLite DDL, applied by `onceq init`).
-- Sales are keyed by day, so one step of a report scans one day.
CREATE TABLE IF NOT EXISTS sales (
    day TEXT NOT NULL,
    seq INTEGER NOT NULL,
    amount INTEGER NOT NULL,
    PRIMARY KEY (day, seq)
);
-- One row per report: its progress, checkpointed by every step.
CREATE TABLE IF NOT EXISTS reports (
    id TEXT PRIMARY KEY,
    days_done INTEGER NOT NULL,
    days_total INTEGER NOT NULL,
    sales INTEGER NOT NULL,
    total INTEGER NOT NULL,
    status TEXT NOT NULL,
    updated_at TIMESTAMP NOT NULL
);
