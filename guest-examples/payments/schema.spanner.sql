-- Business tables of the payments example (GoogleSQL, for spanner:// stores).
CREATE TABLE accounts (
    id STRING(64) NOT NULL,
    balance INT64 NOT NULL,
    updated_at TIMESTAMP
) PRIMARY KEY (id);
CREATE TABLE orders (
    id STRING(64) NOT NULL,
    account_id STRING(64) NOT NULL,
    amount INT64 NOT NULL,
    status STRING(16) NOT NULL,
    created_at TIMESTAMP NOT NULL
) PRIMARY KEY (id);
