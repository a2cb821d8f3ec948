-- Orders (seed 000). Amounts are integers in minor units (cents).
CREATE TABLE IF NOT EXISTS orders (
    id          uuid        PRIMARY KEY,
    customer_id text        NOT NULL,
    status      text        NOT NULL,
    total_minor bigint      NOT NULL CHECK (total_minor > 0),
    placed_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS order_lines (
    order_id         uuid   NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no          int    NOT NULL,
    sku              text   NOT NULL,
    quantity         int    NOT NULL CHECK (quantity > 0),
    unit_price_minor bigint NOT NULL CHECK (unit_price_minor > 0),
    PRIMARY KEY (order_id, line_no)
);
