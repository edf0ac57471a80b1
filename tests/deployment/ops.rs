//! The operator's files under `ops/`: the Prometheus alert rules pass
//! `promtool check rules` and their unit tests, every alert has a severity,
//! its annotations, a runbook section and a firing and a silent test case,
//! the Grafana dashboard is well-formed JSON whose queries parse, and every
//! metric name the rules, their tests and the dashboard use is one the crate
//! exports. And what a packager reads next to them: Cargo.toml's
//! `rust-version` is no older than any dependency in Cargo.lock needs, and
//! its dependency floors are no lower than the APIs the code uses, and
//! README's MSRV badge says it.
//!
//! Needs `promtool` (Debian/Ubuntu: `apt-get install prometheus`), or its
//! path in `PROMTOOL`; without it the promtool tests fail and say so.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    io::ErrorKind,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use tower_idempotency::metrics::{self, Outcome};

/// Every name in `tower_idempotency::metrics`; `src/metrics.rs` is checked
/// against it, so that the list cannot fall behind.
const EXPORTED: &[&str] = &[
    metrics::REQUESTS_TOTAL,
    metrics::CLAIM_DURATION_SECONDS,
    metrics::KEY_HELD_SECONDS,
    metrics::EXPIRED_REMOVED_TOTAL,
    metrics::CLEANUP_BACKLOG,
    metrics::OLDEST_IN_PROGRESS_SECONDS,
    metrics::DUPLICATE_WAIT_SECONDS,
    metrics::HANDLER_TIMEOUTS_TOTAL,
    metrics::COMMITS_LOST_TOTAL,
    metrics::OPERATIONS_RUNNING,
    metrics::LEASE_TAKEOVERS_TOTAL,
    metrics::FENCED_TOTAL,
    metrics::RECOVERIES_TOTAL,
    metrics::OPERATION_ATTEMPTS_TOTAL,
    metrics::OPERATIONS_FAILED_TOTAL,
    metrics::OLDEST_LEASE_SECONDS,
    metrics::EXPIRED_LEASES,
    metrics::OUTBOX_BACKLOG,
    metrics::OUTBOX_LAG_SECONDS,
    metrics::OUTBOX_DELIVERED_TOTAL,
    metrics::OUTBOX_FAILED_TOTAL,
    metrics::OUTBOX_PARKED_TOTAL,
    metrics::OUTBOX_RELAY_RESTARTS_TOTAL,
    metrics::CLIENT_ATTEMPTS_TOTAL,
    metrics::CLIENT_RETRIES_TOTAL,
    metrics::CLIENT_GIVE_UPS_TOTAL,
    metrics::CLIENT_REPLAYED_TOTAL,
];

/// What the rules must watch, at the least.
const WATCHED_BY_RULES: &[&str] = &[
    metrics::OLDEST_LEASE_SECONDS,
    metrics::EXPIRED_LEASES,
    metrics::OLDEST_IN_PROGRESS_SECONDS,
    metrics::REQUESTS_TOTAL,
    metrics::FENCED_TOTAL,
    metrics::LEASE_TAKEOVERS_TOTAL,
    metrics::OPERATIONS_FAILED_TOTAL,
    metrics::OUTBOX_LAG_SECONDS,
    metrics::OUTBOX_PARKED_TOTAL,
    metrics::CLEANUP_BACKLOG,
    metrics::CLIENT_GIVE_UPS_TOTAL,
];

const RULES: &str = "ops/prometheus/alerts.yml";
const RULE_TESTS: &str = "ops/prometheus/alerts_test.yml";
const DASHBOARD: &str = "ops/grafana/tower-idempotency.json";
const RUNBOOK: &str = "ops/RUNBOOK.md";

fn path(relative: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(relative)
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(path(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

// ---------------------------------------------------------------- the exported names

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// `pub const NAME: &str = "value";` lines of `src/metrics.rs`, with the kind
/// the first word of their doc comment gives.
fn names_in_metrics_rs() -> BTreeMap<String, Kind> {
    let source = read("src/metrics.rs");
    let mut names = BTreeMap::new();
    let mut doc = Vec::new();
    for line in source.lines().map(str::trim) {
        if let Some(text) = line.strip_prefix("///") {
            doc.push(text.trim().to_owned());
            continue;
        }
        if let Some(rest) = line.strip_prefix("pub const ") {
            if let Some((_, value)) = rest.split_once(": &str = \"") {
                let value = value
                    .strip_suffix("\";")
                    .unwrap_or_else(|| panic!("src/metrics.rs: cannot read `{line}`"));
                let first = doc.first().map(String::as_str).unwrap_or_default();
                let kind = if first.starts_with("Counter") {
                    Kind::Counter
                } else if first.starts_with("Gauge") {
                    Kind::Gauge
                } else if first.starts_with("Histogram") {
                    Kind::Histogram
                } else {
                    panic!("src/metrics.rs: the doc of {value} does not start with its kind: {first:?}")
                };
                names.insert(value.to_owned(), kind);
            }
        }
        doc.clear();
    }
    names
}

/// The names a PromQL query may use: the exported names, and a histogram's
/// `_bucket`, `_sum` and `_count` series (the exporter renders histograms as
/// summaries unless given buckets; `_sum` and `_count` exist either way).
fn queryable(exported: &BTreeMap<String, Kind>) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (name, kind) in exported {
        names.insert(name.clone());
        if *kind == Kind::Histogram {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

fn exported() -> BTreeSet<String> {
    queryable(&names_in_metrics_rs())
}

#[test]
fn the_list_of_names_matches_src_metrics_rs() {
    let parsed = names_in_metrics_rs();
    let listed: BTreeSet<&str> = EXPORTED.iter().copied().collect();
    let parsed_names: BTreeSet<&str> = parsed.keys().map(String::as_str).collect();
    assert_eq!(
        listed, parsed_names,
        "src/metrics.rs and the EXPORTED list in tests/deployment/ops.rs disagree: add the new constant to the list"
    );
    let histograms: Vec<&str> = parsed
        .iter()
        .filter(|(_, kind)| **kind == Kind::Histogram)
        .map(|(name, _)| name.as_str())
        .collect();
    assert_eq!(
        histograms,
        [
            metrics::CLAIM_DURATION_SECONDS,
            metrics::DUPLICATE_WAIT_SECONDS,
            metrics::KEY_HELD_SECONDS
        ],
        "the histograms of src/metrics.rs, by their doc comments"
    );
}

// ---------------------------------------------------------------- the extractor

/// Identifiers in a PromQL expression that look like this crate's metrics
/// (`idempotency_…`, `outbox_…`). Quoted strings (label values) are skipped.
fn metric_tokens(expr: &str) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((start, c)) = chars.next() {
        if c == '"' || c == '\'' || c == '`' {
            let mut escaped = false;
            for (_, d) in chars.by_ref() {
                if escaped {
                    escaped = false;
                } else if d == '\\' && c != '`' {
                    escaped = true;
                } else if d == c {
                    break;
                }
            }
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            let mut end = start + c.len_utf8();
            while let Some(&(i, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' || d == ':' {
                    end = i + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            let token = &expr[start..end];
            let lower_snake = token
                .chars()
                .all(|d| d.is_ascii_lowercase() || d.is_ascii_digit() || d == '_');
            if (token.starts_with("idempotency_") || token.starts_with("outbox_")) && lower_snake {
                tokens.push(token.to_owned());
            }
        }
    }
    tokens
}

/// The names in `exprs` that the crate does not export, with where they are.
fn unknown_metrics<'a>(
    exprs: impl IntoIterator<Item = &'a (String, String)>,
    exported: &BTreeSet<String>,
) -> Vec<String> {
    let mut unknown = Vec::new();
    for (place, expr) in exprs {
        for token in metric_tokens(expr) {
            if !exported.contains(&token) {
                unknown.push(format!("{token} (in {place})"));
            }
        }
    }
    unknown
}

/// Values a matcher on `label` names (`label="a"`, `label=~"a|b"`, `!=`, `!~`).
fn label_values(expr: &str, label: &str) -> Vec<String> {
    let mut values = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find(label) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + label.len()..].trim_start();
        rest = &rest[at + label.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let Some(after) = ["=~", "!~", "!=", "="]
            .iter()
            .find_map(|op| after.strip_prefix(op))
        else {
            continue;
        };
        let Some(quoted) = after.trim_start().strip_prefix('"') else {
            continue;
        };
        let value = quoted.split('"').next().unwrap_or_default();
        values.extend(value.split('|').map(str::to_owned));
    }
    values
}

#[test]
fn the_extractor_catches_a_misspelled_metric() {
    let exported = exported();
    let good = (
        "good".to_owned(),
        r#"sum by (endpoint) (rate(idempotency_requests_total{outcome="key_reused", endpoint=~"$endpoint"}[5m]))
           / on (endpoint) group_left sum(idempotency_claim_duration_seconds_bucket) > idempotency_outbox_lag_seconds"#
            .to_owned(),
    );
    assert_eq!(unknown_metrics([&good], &exported), Vec::<String>::new());
    assert_eq!(
        metric_tokens(&good.1),
        [
            "idempotency_requests_total",
            "idempotency_claim_duration_seconds_bucket",
            "idempotency_outbox_lag_seconds"
        ]
    );

    let misspelled = (
        "bad".to_owned(),
        r#"rate(idempotency_request_total{outcome="new"}[5m]) > 0 and outbox_lag_second > 1"#
            .to_owned(),
    );
    assert_eq!(
        unknown_metrics([&misspelled], &exported),
        [
            "idempotency_request_total (in bad)",
            "outbox_lag_second (in bad)"
        ]
    );
    // Suffixes belong to histograms only.
    let suffixed = (
        "suffix".to_owned(),
        "idempotency_requests_total_bucket + outbox_lag_seconds_count + idempotency_key_held_seconds_sum"
            .to_owned(),
    );
    assert_eq!(
        unknown_metrics([&suffixed], &exported),
        [
            "idempotency_requests_total_bucket (in suffix)",
            "outbox_lag_seconds_count (in suffix)"
        ]
    );
    // Label values are not metric names.
    assert!(metric_tokens(r#"up{job="idempotency_whatever"}"#).is_empty());
    assert_eq!(
        label_values(
            r#"x{outcome=~"key_reused|in_progress", endpoint="e"} + y{outcome = "new"}"#,
            "outcome"
        ),
        ["key_reused", "in_progress", "new"]
    );
}

// ---------------------------------------------------------------- reading the rules

/// The values of `key:` in a YAML file, with where each is: plain, quoted,
/// or a block scalar (`|`, `>`) on the lines indented below it.
fn yaml_values(file: &str, text: &str, key: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut values = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let item = trimmed.strip_prefix("- ").unwrap_or(trimmed);
        let Some(rest) = item.strip_prefix(key).and_then(|r| r.strip_prefix(':')) else {
            continue;
        };
        let rest = rest.trim();
        let value = if rest.starts_with('|') || rest.starts_with('>') {
            let indent = line.len() - trimmed.len();
            lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .map(|l| l.trim())
                .collect::<Vec<_>>()
                .join("\n")
        } else {
            rest.trim_matches(|c| c == '\'' || c == '"').to_owned()
        };
        values.push((format!("{file}:{}", n + 1), value));
    }
    values
}

struct Alert {
    name: String,
    block: String,
}

fn alerts() -> Vec<Alert> {
    let text = read(RULES);
    let mut alerts: Vec<Alert> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.trim_start().strip_prefix("- alert:") {
            alerts.push(Alert {
                name: name.trim().to_owned(),
                block: String::new(),
            });
        } else if line.trim_start().starts_with("- name:") {
            // A new group: its lines belong to no alert.
            alerts.push(Alert {
                name: String::new(),
                block: String::new(),
            });
        }
        if let Some(alert) = alerts.last_mut() {
            alert.block.push_str(line);
            alert.block.push('\n');
        }
    }
    alerts.retain(|a| !a.name.is_empty());
    alerts
}

#[test]
fn the_rules_use_only_exported_metrics() {
    let exported = exported();
    let exprs = yaml_values(RULES, &read(RULES), "expr");
    assert!(
        exprs.len() >= 10,
        "{RULES}: expected at least 10 rules, found {} expressions",
        exprs.len()
    );
    let unknown = unknown_metrics(&exprs, &exported);
    assert!(
        unknown.is_empty(),
        "{RULES} uses metrics the crate does not export: {unknown:?}"
    );
    let used: BTreeSet<String> = exprs.iter().flat_map(|(_, e)| metric_tokens(e)).collect();
    assert!(
        used.len() >= 11,
        "{RULES}: expected at least 11 distinct metrics, found {used:?}"
    );
    for name in WATCHED_BY_RULES {
        assert!(used.contains(*name), "{RULES}: no rule watches {name}");
    }
    let outcomes: BTreeSet<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    for (place, expr) in &exprs {
        for value in label_values(expr, "outcome") {
            assert!(
                outcomes.contains(value.as_str()),
                "{place}: outcome {value:?} is not one of {outcomes:?}"
            );
        }
    }
}

#[test]
fn the_rule_tests_feed_only_exported_metrics() {
    let exported = exported();
    let text = read(RULE_TESTS);
    let series = yaml_values(RULE_TESTS, &text, "series");
    assert!(
        series.len() >= 20,
        "{RULE_TESTS}: expected input series, found {}",
        series.len()
    );
    let unknown = unknown_metrics(&series, &exported);
    assert!(
        unknown.is_empty(),
        "{RULE_TESTS} feeds metrics the crate does not export: {unknown:?}"
    );
}

/// GitHub's anchor for a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

#[test]
fn every_alert_has_a_severity_annotations_a_runbook_section_and_tests() {
    let alerts = alerts();
    assert!(alerts.len() >= 10, "{RULES}: only {} alerts", alerts.len());
    let runbook = read(RUNBOOK);
    let anchors: BTreeSet<String> = runbook
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| anchor(l.trim_start_matches('#')))
        .collect();
    let tests = read(RULE_TESTS);
    let test_lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let mut names = BTreeSet::new();
    for alert in &alerts {
        let name = &alert.name;
        assert!(names.insert(name.clone()), "{RULES}: {name} twice");
        let value = |key: &str| {
            yaml_values(RULES, &alert.block, key)
                .into_iter()
                .next()
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("{RULES}: {name} has no {key}"))
        };
        let severity = value("severity");
        assert!(
            ["critical", "warning"].contains(&severity.as_str()),
            "{RULES}: {name} has severity {severity:?}"
        );
        assert!(value("summary").len() > 20, "{name}: summary too short");
        assert!(
            value("description").contains("Threshold"),
            "{name}: the description must say which threshold to tune"
        );
        let runbook_url = value("runbook_url");
        let expected = format!("{RUNBOOK}#{}", name.to_lowercase());
        assert_eq!(runbook_url, expected, "{RULES}: {name}'s runbook_url");
        assert!(
            anchors.contains(&name.to_lowercase()),
            "{RUNBOOK} has no section {name} (anchor #{})",
            name.to_lowercase()
        );

        // A case where it fires and one where it stays silent.
        let (mut fires, mut silent) = (false, false);
        for (n, line) in test_lines.iter().enumerate() {
            if line.strip_prefix("alertname:").map(str::trim) != Some(name.as_str()) {
                continue;
            }
            match test_lines.get(n + 1) {
                Some(&"exp_alerts: []") => silent = true,
                Some(&"exp_alerts:") => fires = true,
                other => panic!("{RULE_TESTS}: after `alertname: {name}` comes {other:?}"),
            }
        }
        assert!(fires, "{RULE_TESTS}: no case where {name} fires");
        assert!(silent, "{RULE_TESTS}: no case where {name} stays silent");
    }
}

// ---------------------------------------------------------------- promtool

fn promtool(args: &[&str]) -> Output {
    let program = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".to_owned());
    match Command::new(&program)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
    {
        Ok(output) => output,
        Err(e) if e.kind() == ErrorKind::NotFound => panic!(
            "`{program}` not found: the alert rules are checked with promtool. Install it \
             (Debian/Ubuntu: `apt-get install prometheus`) or set PROMTOOL to its path."
        ),
        Err(e) => panic!("cannot run `{program}`: {e}"),
    }
}

fn assert_success(what: &str, output: &Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    stdout
}

#[test]
fn promtool_checks_the_rules_and_runs_their_tests() {
    let checked = assert_success(
        "promtool check rules",
        &promtool(&["check", "rules", RULES]),
    );
    assert!(checked.contains("SUCCESS"), "{checked}");
    let tested = promtool(&["test", "rules", RULE_TESTS]);
    let out = assert_success("promtool test rules", &tested);
    let all = format!("{out}{}", String::from_utf8_lossy(&tested.stderr));
    assert!(all.contains("SUCCESS"), "{all}");
}

// ---------------------------------------------------------------- the dashboard

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read(DASHBOARD))
        .unwrap_or_else(|e| panic!("{DASHBOARD} is not valid JSON: {e}"))
}

/// Every panel, rows' collapsed panels included.
fn panels(dashboard: &serde_json::Value) -> Vec<&serde_json::Value> {
    let mut all = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        all.push(panel);
        if let Some(inner) = panel["panels"].as_array() {
            all.extend(inner);
        }
    }
    all
}

/// Each target's expression, with the panel's title.
fn dashboard_exprs(dashboard: &serde_json::Value) -> Vec<(String, String)> {
    let mut exprs = Vec::new();
    for panel in panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default();
            exprs.push((format!("panel {title:?}"), expr.to_owned()));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
    {
        let query = match &variable["query"] {
            serde_json::Value::String(q) => q.clone(),
            q => q["query"].as_str().unwrap_or_default().to_owned(),
        };
        exprs.push((format!("variable {}", variable["name"]), query));
    }
    exprs
}

#[test]
fn the_dashboard_is_well_formed_and_uses_only_exported_metrics() {
    let dashboard = dashboard();
    assert!(
        dashboard["schemaVersion"].as_u64().unwrap_or(0) >= 39,
        "schemaVersion"
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("{DASHBOARD}: no variable {name}"))
    };
    assert_eq!(variable("DS_PROMETHEUS")["type"], "datasource");
    assert_eq!(variable("DS_PROMETHEUS")["query"], "prometheus");
    let endpoint = &variable("endpoint")["query"];
    assert_eq!(
        endpoint.as_str().or(endpoint["query"].as_str()),
        Some("label_values(idempotency_requests_total, endpoint)")
    );

    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().expect("every panel has a title");
        let id = panel["id"].as_u64().expect("every panel has an id");
        assert!(ids.insert(id), "{DASHBOARD}: panel id {id} twice");
        titles.insert(title);
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${DS_PROMETHEUS}",
            "panel {title:?}: datasource"
        );
        let targets = panel["targets"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        assert!(!targets.is_empty(), "panel {title:?} has no target");
        for target in targets {
            let expr = target["expr"].as_str().unwrap_or_default();
            assert!(
                !expr.trim().is_empty(),
                "panel {title:?} has a target without expr"
            );
        }
    }
    assert!(ids.len() >= 20, "{DASHBOARD}: only {} panels", ids.len());

    let exprs = dashboard_exprs(&dashboard);
    let unknown = unknown_metrics(&exprs, &exported());
    assert!(
        unknown.is_empty(),
        "{DASHBOARD} uses metrics the crate does not export: {unknown:?}"
    );
    let used: BTreeSet<String> = exprs.iter().flat_map(|(_, e)| metric_tokens(e)).collect();
    let base: BTreeSet<&str> = used
        .iter()
        .map(|n| {
            EXPORTED
                .iter()
                .copied()
                .filter(|e| n.starts_with(e))
                .max_by_key(|e| e.len())
                .unwrap_or(n)
        })
        .collect();
    let missing: Vec<&&str> = EXPORTED.iter().filter(|n| !base.contains(**n)).collect();
    assert!(
        missing.is_empty(),
        "{DASHBOARD} shows no panel for {missing:?}"
    );
    for (place, expr) in &exprs {
        for value in label_values(expr, "outcome") {
            assert!(
                Outcome::ALL.iter().any(|o| o.as_str() == value),
                "{place}: outcome {value:?} is not an outcome"
            );
        }
    }
}

#[test]
fn the_dashboard_queries_parse() {
    // Each panel's query as a recording rule, Grafana's variables replaced,
    // so that promtool parses it.
    let dashboard = dashboard();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    let mut count = 0;
    for (place, expr) in dashboard_exprs(&dashboard) {
        if place.starts_with("variable") {
            continue;
        }
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$__range", "1h")
            .replace("$job", ".*")
            .replace("$endpoint", ".*");
        assert!(!expr.contains('$'), "{place}: unknown variable in {expr}");
        count += 1;
        rules.push_str(&format!(
            "      - record: dashboard:query_{count}\n        expr: {}\n",
            serde_json::Value::String(expr)
        ));
    }
    let dir = std::env::temp_dir().join(format!("tower-idempotency-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dashboard_queries.yml");
    std::fs::write(&file, &rules).unwrap();
    let output = promtool(&["check", "rules", file.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    let out = assert_success("promtool check rules (the dashboard's queries)", &output);
    assert!(out.contains(&format!("{count} rules found")), "{out}");
}

// ---------------------------------------------------------------- rust-version

/// A `rust-version` (`1.89` or `1.89.0`) as numbers; a missing part is 0.
fn rust_version(text: &str) -> (u64, u64, u64) {
    let mut parts = text.split('.').map(|part| {
        part.parse::<u64>()
            .unwrap_or_else(|e| panic!("rust-version {text:?}: {e}"))
    });
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// What `cargo metadata --locked --all-features` says about this crate's
/// build: the package of each id, and for each package reached from the
/// crate over normal and build dependencies (every feature, every
/// platform), the package that first reached it. Dev-dependencies are left
/// out: they build the crate's tests and benches, not a user's build.
struct Resolved {
    metadata: serde_json::Value,
}

impl Resolved {
    fn load() -> Self {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(&cargo)
            .args([
                "metadata",
                "--format-version",
                "1",
                "--locked",
                "--all-features",
            ])
            .arg("--manifest-path")
            .arg(path("Cargo.toml"))
            .output()
            .unwrap_or_else(|e| panic!("cannot run {cargo:?} metadata: {e}"));
        let stdout = assert_success("cargo metadata --locked", &output);
        let metadata = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("cargo metadata printed no JSON: {e}"));
        Resolved { metadata }
    }

    fn packages(&self) -> BTreeMap<&str, &serde_json::Value> {
        let packages = self.metadata["packages"].as_array().expect("packages");
        packages
            .iter()
            .map(|p| (p["id"].as_str().expect("a package id"), p))
            .collect()
    }

    fn root(&self) -> &str {
        self.metadata["resolve"]["root"]
            .as_str()
            .expect("the resolve has this crate as its root")
    }

    /// Each package of the build, with the one that depends on it (none
    /// for the crate itself).
    fn build(&self) -> BTreeMap<&str, Option<&str>> {
        let nodes: BTreeMap<&str, &serde_json::Value> = self.metadata["resolve"]["nodes"]
            .as_array()
            .expect("resolve nodes")
            .iter()
            .map(|n| (n["id"].as_str().expect("a node id"), n))
            .collect();
        let root = self.root();
        let mut via = BTreeMap::from([(root, None)]);
        let mut queue = VecDeque::from([root]);
        while let Some(id) = queue.pop_front() {
            for dep in nodes[id]["deps"].as_array().expect("a node's deps") {
                let kinds = dep["dep_kinds"].as_array().expect("dep_kinds");
                let dev_only = !kinds.is_empty() && kinds.iter().all(|k| k["kind"] == "dev");
                let pkg = dep["pkg"].as_str().expect("a dependency's id");
                if !dev_only && !via.contains_key(pkg) {
                    via.insert(pkg, Some(id));
                    queue.push_back(pkg);
                }
            }
        }
        via
    }
}

#[test]
fn no_dependency_needs_a_newer_rust_than_rust_version() {
    let resolved = Resolved::load();
    let packages = resolved.packages();
    let build = resolved.build();
    let name = |id: &str| {
        let p = packages[id];
        format!(
            "{} {}",
            p["name"].as_str().unwrap(),
            p["version"].as_str().unwrap()
        )
    };

    // The walk reaches what a user builds and nothing that only the tests do.
    let names: BTreeSet<&str> = build
        .keys()
        .map(|id| packages[id]["name"].as_str().unwrap())
        .collect();
    for normal in ["serde", "tokio", "tokio-postgres", "sqlx", "tower"] {
        assert!(names.contains(normal), "the walk missed {normal}");
    }
    // (tracing-subscriber is not among them: the `opentelemetry` feature's
    // tracing-opentelemetry builds on it.)
    for dev_only in ["proptest", "criterion", "metrics-exporter-prometheus"] {
        assert!(!names.contains(dev_only), "the walk took in {dev_only}");
    }

    let ours_text = packages[resolved.root()]["rust_version"]
        .as_str()
        .expect("Cargo.toml sets rust-version");
    let ours = rust_version(ours_text);
    let newer: Vec<String> = build
        .keys()
        .filter_map(|&id| {
            let theirs = packages[id]["rust_version"].as_str()?;
            if rust_version(theirs) <= ours {
                return None;
            }
            let mut chain = vec![name(id)];
            let mut at = build[id];
            while let Some(parent) = at {
                chain.push(name(parent));
                at = build[parent];
            }
            Some(format!(
                "{} needs Rust {theirs} ({})",
                chain[0],
                chain.join(" <- ")
            ))
        })
        .collect();
    assert!(
        newer.is_empty(),
        "Cargo.toml says rust-version = \"{ours_text}\", but Cargo.lock resolves \
         dependencies that need a newer Rust; raise rust-version to the highest:\n  {}",
        newer.join("\n  ")
    );
}

/// The lowest version of a dependency that has every API the library uses,
/// and the newest of those APIs: Cargo.toml's requirement must not go below
/// it, or a build resolved to the floor (`-Z minimal-versions`, an old
/// lock file) would not compile.
const FLOORS: &[(&str, &str, &str)] = &[
    ("tokio", "1.33", "watch::Sender::new"),
    ("tokio-postgres", "0.7.17", "Client::execute_typed"),
    ("sqlx", "0.9", "SqlStr and AssertSqlSafe"),
];

#[test]
fn dependency_floors_are_no_lower_than_the_apis_the_code_uses() {
    let resolved = Resolved::load();
    let packages = resolved.packages();
    let ours = packages[resolved.root()]["dependencies"]
        .as_array()
        .expect("the crate's dependencies");
    for &(name, floor, why) in FLOORS {
        // The library's own requirement, not a dev-dependency's.
        let req = ours
            .iter()
            .find(|d| d["name"] == name && d["kind"].is_null())
            .and_then(|d| d["req"].as_str())
            .unwrap_or_else(|| panic!("{name} is not a dependency of the library"));
        let version = req
            .strip_prefix('^')
            .unwrap_or_else(|| panic!("{name}'s requirement {req:?} is not a caret requirement"));
        assert!(
            rust_version(version) >= rust_version(floor),
            "Cargo.toml requires {name} {req}, but the code uses {why}, which needs {floor}"
        );
    }
}

#[test]
fn the_readme_msrv_badge_is_rust_version() {
    let resolved = Resolved::load();
    let ours = resolved.packages()[resolved.root()]["rust_version"]
        .as_str()
        .expect("Cargo.toml sets rust-version")
        .to_owned();
    let readme = read("README.md");
    let badge = format!("[![MSRV {ours}](https://img.shields.io/badge/MSRV-{ours}-blue.svg)]");
    assert!(
        readme.lines().take(6).any(|line| line.starts_with(&badge)),
        "README.md's MSRV badge at the top must say rust-version {ours}: {badge}"
    );
}
