//! Shared by the end-to-end tests: the drill table's rows.

/// One row of the drill table (`scripts/drills`): what a fault drill offered, recorded, lost and
/// duplicated, and whether the balance held. Printed; the script collects the rows.
pub fn drill(name: &str, sent: u64, recorded: u64, duplicated: u64, balance_holds: bool) {
    println!(
        "DRILL|{name}|{sent}|{recorded}|{}|{duplicated}|{}",
        sent.saturating_sub(recorded),
        if balance_holds { "holds" } else { "IMBALANCE" }
    );
}
