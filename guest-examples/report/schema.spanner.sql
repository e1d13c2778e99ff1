-- Business tables of the report example (GoogleSQL, for spanner:// stores).
CREATE TABLE sales (
    day STRING(10) NOT NULL,
    seq INT64 NOT NULL,
    amount INT64 NOT NULL
) PRIMARY KEY (day, seq);
CREATE TABLE reports (
    id STRING(64) NOT NULL,
    days_done INT64 NOT NULL,
    days_total INT64 NOT NULL,
    sales INT64 NOT NULL,
    total INT64 NOT NULL,
    status STRING(16) NOT NULL,
    updated_at TIMESTAMP NOT NULL
) PRIMARY KEY (id);
