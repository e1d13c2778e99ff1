-- Business tables of the inventory example (GoogleSQL, for spanner:// stores).
CREATE TABLE items (
    sku STRING(64) NOT NULL,
    stock INT64 NOT NULL
) PRIMARY KEY (sku);
CREATE TABLE reservations (
    order_id STRING(64) NOT NULL,
    sku STRING(64) NOT NULL,
    qty INT64 NOT NULL,
    status STRING(16) NOT NULL
) PRIMARY KEY (order_id);
