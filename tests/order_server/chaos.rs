//! A short process crash soak: the `chaos` example SIGKILLs the example
//! order server at random moments while 8 clients retry their operations,
//! restarts it, and checks the database with SQL; here its summary is held
//! to the guarantees, in both modes of `POST /orders`. (`TESTING.md` keeps
//! a longer run.)

use crate::common::example_binary;

use std::collections::HashMap;

use example_binary::{both_modes, example, example_binary, Mode};

/// The summary table's rows, `| name | value |`, by name.
fn summary(stdout: &str) -> HashMap<String, String> {
    stdout
        .lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line
                .trim()
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split('|')
                .map(str::trim)
                .collect();
            match cells[..] {
                [name, value] => Some((name.to_owned(), value.to_owned())),
                _ => None,
            }
        })
        .collect()
}

fn sigkilled_server_leaves_one_order_event_result_and_charge_per_operation(mode: Mode) {
    // The soak runs this server binary; both must be as new as their sources.
    let server = example_binary();
    let chaos = example("chaos", &["examples/chaos.rs", "Cargo.toml"]);
    let output = std::process::Command::new(chaos)
        .args([
            "--ops",
            "120",
            "--crashes",
            "2",
            "--clients",
            "8",
            "--seed",
            "13",
            "--mode",
            mode.name(),
        ])
        .arg("--server")
        .arg(server)
        .output()
        .expect("the chaos example runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let rows = summary(&stdout);
    let row = |name: &str| -> &str {
        rows.get(name)
            .unwrap_or_else(|| panic!("no {name:?} row in\n{stdout}\n{stderr}"))
    };
    let number = |name: &str| -> u64 {
        row(name)
            .parse()
            .unwrap_or_else(|_| panic!("{name:?} is {:?}\n{stdout}\n{stderr}", row(name)))
    };
    assert_eq!(row("mode"), mode.name());
    assert_eq!(number("operations"), 120);
    assert_eq!(number("crashes"), 2, "the server was killed twice");
    assert!(
        number("retries after a connection error") > 0,
        "the crashes cut requests off\n{stdout}"
    );
    assert_eq!(number("orders"), 120, "{stdout}\n{stderr}");
    assert_eq!(number("duplicates"), 0, "{stdout}\n{stderr}");
    assert_eq!(number("lost"), 0, "{stdout}\n{stderr}");
    assert_eq!(number("mismatched answers"), 0, "{stdout}\n{stderr}");
    for per in [
        "outbox events per order",
        "remembered results per operation",
        "charges per order",
    ] {
        assert_eq!(row(per), "1", "{per}\n{stdout}\n{stderr}");
    }
    assert!(
        output.status.success(),
        "the soak reports a failure: {}\n{stdout}\n{stderr}",
        output.status
    );
}

both_modes!(sync sigkilled_server_leaves_one_order_event_result_and_charge_per_operation);
