//! Orders (seed 000): the order rows and their `OrderPlaced` event are
//! written in one transaction.
//!
//! ```no_run
//! # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use outbox_sdk::orders::{Order, OrderLine, OrderRepository};
//! use outbox_sdk::outbox::Headers;
//! let order = Order::place("customer-7", vec![OrderLine::new("SKU-1", 2, 1250)])?;
//! let mut headers = Headers::new();
//! headers.set_correlation_id("req-42");
//! let tx = client.transaction().await?;
//! OrderRepository::save(&tx, &order, headers).await?;
//! tx.commit().await?; // order, lines and event, or nothing
//! # Ok(()) }
//! ```

use chrono::{DateTime, Utc};
use serde_json::json;
use tokio_postgres::Transaction;
use uuid::Uuid;

use crate::error::SdkError;
use crate::outbox::{append, Headers, OutboxEvent};

/// The aggregate type of orders: outboxd publishes to `order.events`.
pub const AGGREGATE_TYPE: &str = "Order";
/// The event written when an order is placed.
pub const ORDER_PLACED: &str = "ordering.order-placed.v1";

/// One line of an order. Prices are integers in minor units (cents).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrderLine {
    pub sku: String,
    pub quantity: i32,
    pub unit_price_minor: i64,
}

impl OrderLine {
    pub fn new(sku: impl Into<String>, quantity: i32, unit_price_minor: i64) -> Self {
        OrderLine {
            sku: sku.into(),
            quantity,
            unit_price_minor,
        }
    }
}

/// An order that broke a rule when placed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OrderError {
    #[error("an order needs at least one line")]
    NoLines,
    #[error("an order needs a customer id")]
    NoCustomer,
    #[error("line {line}: the SKU is empty")]
    EmptySku { line: usize },
    #[error("line {line}: quantity must be positive, got {quantity}")]
    NonPositiveQuantity { line: usize, quantity: i32 },
    #[error("line {line}: unit price must be positive, got {price}")]
    NonPositivePrice { line: usize, price: i64 },
    #[error("the order total does not fit in 64 bits")]
    TotalOverflow,
}

/// A placed order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Order {
    pub id: Uuid,
    pub customer_id: String,
    pub lines: Vec<OrderLine>,
    pub total_minor: i64,
    pub placed_at: DateTime<Utc>,
}

impl Order {
    /// Validates and places an order: at least one line, positive
    /// quantities and prices.
    pub fn place(customer_id: impl Into<String>, lines: Vec<OrderLine>) -> Result<Order, OrderError> {
        let customer_id = customer_id.into();
        if customer_id.trim().is_empty() {
            return Err(OrderError::NoCustomer);
        }
        if lines.is_empty() {
            return Err(OrderError::NoLines);
        }
        let mut total: i64 = 0;
        for (i, l) in lines.iter().enumerate() {
            let line = i + 1;
            if l.sku.trim().is_empty() {
                return Err(OrderError::EmptySku { line });
            }
            if l.quantity <= 0 {
                return Err(OrderError::NonPositiveQuantity {
                    line,
                    quantity: l.quantity,
                });
            }
            if l.unit_price_minor <= 0 {
                return Err(OrderError::NonPositivePrice {
                    line,
                    price: l.unit_price_minor,
                });
            }
            total = l
                .unit_price_minor
                .checked_mul(i64::from(l.quantity))
                .and_then(|v| total.checked_add(v))
                .ok_or(OrderError::TotalOverflow)?;
        }
        Ok(Order {
            id: Uuid::now_v7(),
            customer_id,
            lines,
            total_minor: total,
            placed_at: Utc::now(),
        })
    }

    /// The `OrderPlaced` integration event.
    pub fn placed_event(&self) -> OutboxEvent {
        let lines: Vec<_> = self
            .lines
            .iter()
            .map(|l| json!({"sku": l.sku, "quantity": l.quantity, "unitPriceMinor": l.unit_price_minor}))
            .collect();
        OutboxEvent::new(
            AGGREGATE_TYPE,
            self.id.to_string(),
            ORDER_PLACED,
            json!({
                "orderId": self.id,
                "customerId": self.customer_id,
                "lines": lines,
                "totalMinor": self.total_minor,
                "placedAt": self.placed_at,
            }),
        )
    }
}

/// Stores orders.
#[derive(Debug)]
pub struct OrderRepository;

impl OrderRepository {
    /// Writes the order, its lines and its `OrderPlaced` outbox row in the
    /// caller's transaction; returns the event id.
    pub async fn save(tx: &Transaction<'_>, order: &Order, headers: Headers) -> Result<Uuid, SdkError> {
        tx.execute(
            "INSERT INTO orders (id, customer_id, status, total_minor, placed_at) VALUES ($1, $2, 'PLACED', $3, $4)",
            &[&order.id, &order.customer_id, &order.total_minor, &order.placed_at],
        )
        .await?;
        let line_no: Vec<i32> = (1..).take(order.lines.len()).collect();
        let skus: Vec<&str> = order.lines.iter().map(|l| l.sku.as_str()).collect();
        let quantities: Vec<i32> = order.lines.iter().map(|l| l.quantity).collect();
        let prices: Vec<i64> = order.lines.iter().map(|l| l.unit_price_minor).collect();
        tx.execute(
            "INSERT INTO order_lines (order_id, line_no, sku, quantity, unit_price_minor)
             SELECT $1, * FROM unnest($2::int[], $3::text[], $4::int[], $5::bigint[])",
            &[&order.id, &line_no, &skus, &quantities, &prices],
        )
        .await?;
        let mut event = order.placed_event();
        event.headers = headers;
        let ids = append(tx, &[event]).await?;
        ids.into_iter()
            .next()
            .ok_or_else(|| SdkError::InvalidEvent("the outbox returned no id".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placing_validates() {
        let ok = Order::place(
            "c",
            vec![OrderLine::new("A", 2, 150), OrderLine::new("B", 1, 100)],
        )
        .unwrap();
        assert_eq!(ok.total_minor, 400);
        assert_eq!(Order::place("c", vec![]), Err(OrderError::NoLines));
        assert_eq!(
            Order::place(" ", vec![OrderLine::new("A", 1, 1)]),
            Err(OrderError::NoCustomer)
        );
        assert_eq!(
            Order::place("c", vec![OrderLine::new("A", 1, 1), OrderLine::new("B", 0, 1)]),
            Err(OrderError::NonPositiveQuantity { line: 2, quantity: 0 })
        );
        assert_eq!(
            Order::place("c", vec![OrderLine::new("A", 1, -5)]),
            Err(OrderError::NonPositivePrice { line: 1, price: -5 })
        );
        assert_eq!(
            Order::place("c", vec![OrderLine::new("", 1, 1)]),
            Err(OrderError::EmptySku { line: 1 })
        );
        assert_eq!(
            Order::place("c", vec![OrderLine::new("A", i32::MAX, i64::MAX)]),
            Err(OrderError::TotalOverflow)
        );
    }

    #[test]
    fn placed_event_routes_to_order_events() {
        let o = Order::place("c-1", vec![OrderLine::new("A", 2, 150)]).unwrap();
        let e = o.placed_event();
        assert_eq!(
            (e.aggregate_type.as_str(), e.event_type.as_str()),
            ("Order", ORDER_PLACED)
        );
        assert_eq!(e.aggregate_id, o.id.to_string());
        assert_eq!(e.payload["totalMinor"], 300);
    }
}
