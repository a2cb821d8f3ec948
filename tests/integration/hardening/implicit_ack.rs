//! Class 4: librdkafka's implicit acknowledgements. When a later Produce
//! request of a partition succeeds while an earlier one waits for its
//! retry, librdkafka reports the earlier messages delivered, without an
//! offset; a broker with no producer state for the partition accepted the
//! later request without them. Before, outboxd took such a report for a
//! stored record and confirmed past it.

use crate::harness::example_bin;

/// The reduced reproducer (`examples/implicit_ack.rs`) against librdkafka's
/// mock cluster: the messages reported delivered that the partitions do
/// not hold are exactly those reported without an offset, which is what
/// outboxd now refuses to take for stored. The relay under the same faults
/// is `relay::confirmed_lsn_never_passes_an_unacknowledged_event`.
#[test]
fn the_messages_reported_delivered_but_not_stored_are_those_without_an_offset() {
    let mut seen = 0;
    for _ in 0..5 {
        let out = std::process::Command::new(example_bin("implicit_ack"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let number = |label: &str| -> usize {
            text.lines()
                .find_map(|l| l.strip_prefix(label))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no {label:?} in {text}"))
        };
        let (with, without, stored) = (
            number("delivered with an offset:"),
            number("delivered without an offset:"),
            number("the partitions hold:"),
        );
        eprintln!("implicit acknowledgements: {with} with an offset, {without} without, {stored} stored");
        assert_eq!(
            stored, with,
            "every report with an offset is stored, and only those: {text}"
        );
        if without > 0 {
            assert_eq!(out.status.code(), Some(1), "{text}");
            seen += 1;
        }
    }
    assert!(seen > 0, "librdkafka never acknowledged implicitly in 5 runs");
}
