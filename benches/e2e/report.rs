//! The tables, the targets and the `RATIOS` line (the last line of output).

use crate::{
    growth::{self, CleanupRun, Step},
    load::{percentile, Run, Stats},
    pgbench,
    units::{self, Costs},
};

pub(crate) const BARE: &str = "1 bare (no layer)";
pub(crate) const CREATE: &str = "2 layered create";
pub(crate) const REPLAY: &str = "3 replay, cache hits";
pub(crate) const MIXED: &str = "4 mixed 5% retry, 0.1% reuse";
pub(crate) const HOT: &str = "5 hot key (50 duplicates)";
pub(crate) const EXPERIMENT: &str = "6 create, claim at commit (experiment)";
pub(crate) const ONE_COMMIT: &str = "7 create, one-commit mode";
pub(crate) const TYPED: &str = "8 layered create, typed unnamed statements";
pub(crate) const BARE_FIVE: &str = "9 bare, five statements";
pub(crate) const LAYERED_FIVE: &str = "10 layered create, five statements";
pub(crate) const FULL_RECORD: &str = "11 create, claim at commit, full record (experiment)";
pub(crate) const REPLAY_MISS: &str = "12 replay, no cache (the table)";
pub(crate) const ECHO: &str = "13 HTTP echo (static 201)";
pub(crate) const FULL_RECORD_4K: &str = "14 full-record experiment, 4 KB body";
pub(crate) const ONE_COMMIT_4K: &str = "15 one-commit mode, 4 KB body";
pub(crate) const OBSERVED: &str = "16 one-commit mode, observed";
pub(crate) const TRUSTED: &str = "17 one-commit mode, trusted handlers";

/// The proxy section's results.
pub(crate) struct Proxied {
    pub(crate) delay_ms: f64,
    /// The delay chunks really got, (p50, p99) ms.
    pub(crate) measured: (f64, f64),
    pub(crate) rate: f64,
    /// Name, closed-loop runs, open-loop runs.
    pub(crate) rows: Vec<(&'static str, Vec<Run>, Vec<Run>)>,
}

/// Each scenario's name and runs.
pub(crate) type Rows = Vec<(&'static str, Vec<Run>)>;
/// A target: what it says, this run's value, whether the value meets it.
type Target = (String, Option<f64>, fn(f64) -> bool);

#[derive(Default)]
pub(crate) struct Report {
    pub(crate) main: Rows,
    pub(crate) open: Option<(f64, Rows)>,
    pub(crate) proxy: Option<Proxied>,
    pub(crate) growth: Option<Vec<Step>>,
    pub(crate) cleanup: Option<CleanupRun>,
    pub(crate) memory: Option<(f64, usize)>,
    pub(crate) pgbench: Option<pgbench::Results>,
    /// Whether the one-commit mode ran (false: its rows ran the experiment).
    pub(crate) one_commit: bool,
    /// Cost per request in units (round trips, statements, WAL, CPU).
    pub(crate) units: Option<Costs>,
    /// WAL bytes of one key row with its index entries.
    pub(crate) key_row_wal: Option<f64>,
    /// The SQL-level trials' groups.
    pub(crate) trials: Option<Vec<Vec<crate::trials::Trial>>>,
}

impl Report {
    fn main(&self, name: &str) -> Option<Stats> {
        let (_, runs) = self.main.iter().find(|(n, _)| *n == name)?;
        Some(Stats::of(runs))
    }

    fn open(&self, name: &str) -> Option<Stats> {
        let (_, rows) = self.open.as_ref()?;
        let (_, runs) = rows.iter().find(|(n, _)| *n == name)?;
        Some(Stats::of(runs))
    }

    /// The one-commit row's name: the mode once merged, else the experiment.
    fn at_commit_name(&self) -> &'static str {
        if self.one_commit {
            ONE_COMMIT
        } else {
            EXPERIMENT
        }
    }

    pub(crate) fn print(&self) {
        if !self.main.is_empty() {
            println!();
            println!("| scenario | req/s | p50 ms | p99 ms | unexpected answers |");
            println!("| --- | ---: | ---: | ---: | ---: |");
            for (name, runs) in &self.main {
                let s = Stats::of(runs);
                println!(
                    "| {name} | {:.0} | {:.2} | {:.2} | {} |",
                    s.tput, s.p50, s.p99, s.unexpected
                );
            }
        }
        if let Some(costs) = &self.units {
            units::print(costs);
            if let Some(key_row) = self.key_row_wal {
                println!("one key row with its index entries: {key_row:.0} WAL bytes");
            }
        }
        if let Some((rate, rows)) = &self.open {
            println!();
            println!("At a fixed {rate:.0} req/s (half the layered create throughput), open loop:");
            println!();
            println!("| scenario | p50 ms | p99 ms |");
            println!("| --- | ---: | ---: |");
            for (name, runs) in rows {
                let s = Stats::of(runs);
                println!("| {name} | {:.2} | {:.2} |", s.p50, s.p99);
            }
        }
        if let Some((_, runs)) = self.main.iter().find(|(n, _)| *n == HOT) {
            let hot: Vec<i64> = runs
                .iter()
                .flat_map(|r| r.duplicate_extra_us.iter().copied())
                .collect();
            println!();
            println!(
                "hot key: duplicates answered at p99 {:.2} ms after their first request's own answer (target <= 50 ms)",
                percentile(&hot, 0.99) as f64 / 1000.0
            );
        }
        if let Some((memory, body)) = self.memory {
            println!("layer memory per in-flight request (excluding the {body}-byte buffered body): {memory:.0} bytes");
        }
        if let Some(results) = &self.pgbench {
            pgbench::print_summary(results);
            pgbench::print_variants(results);
        }
        if let Some(trials) = &self.trials {
            crate::trials::print(trials);
        }
        if let Some(proxy) = &self.proxy {
            Self::print_proxy(proxy);
        }
        if let Some(steps) = &self.growth {
            growth::print(steps);
            if let Some((normalized, raw)) = growth::create_10m_vs_0(steps) {
                println!();
                println!("growth: create at 10,000,000 keys vs at 0: {normalized:.2} (each over bare in the same step; raw throughput ratio {raw:.2})");
            }
        }
        if let Some(cleanup) = &self.cleanup {
            growth::print_cleanup(cleanup);
        }
        self.print_targets();
    }

    fn print_proxy(p: &Proxied) {
        println!();
        println!(
            "Database behind a loopback proxy adding {:.1} ms each way (delay measured per chunk: p50 {:.2} ms, p99 {:.2} ms); open loop at {:.0} req/s (half the proxied layered create throughput):",
            p.delay_ms, p.measured.0, p.measured.1, p.rate
        );
        println!();
        println!("| scenario | req/s | p50 ms | p99 ms | open-loop p50 ms | open-loop p99 ms | unexpected answers |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
        for (name, closed, open) in &p.rows {
            let (c, o) = (Stats::of(closed), Stats::of(open));
            println!(
                "| {name} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
                c.tput,
                c.p50,
                c.p99,
                o.p50,
                o.p99,
                c.unexpected + o.unexpected
            );
        }
    }

    fn print_targets(&self) {
        let (bare, create, replay, mixed) = (
            self.main(BARE),
            self.main(CREATE),
            self.main(REPLAY),
            self.main(MIXED),
        );
        let at_commit = self.main(self.at_commit_name());
        let ratio =
            |a: Option<Stats>, b: Option<Stats>, f: fn(&Stats) -> f64| Some(f(&a?) / f(&b?));
        let tput = |s: &Stats| s.tput;
        let p99 = |s: &Stats| s.p99;
        let growth = self
            .growth
            .as_deref()
            .and_then(growth::create_10m_vs_0)
            .map(|g| g.0);
        let open_gap = (|| Some(self.open(self.at_commit_name())?.p50 - self.open(BARE)?.p50))();
        let fmt = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{v:.2}"));
        let met = |v: Option<f64>, ok: fn(f64) -> bool| match v {
            Some(v) if ok(v) => "yes",
            Some(_) => "no",
            None => "not run",
        };
        let which = if self.one_commit {
            "one-commit mode"
        } else {
            "claim at commit, the experiment until the mode is merged"
        };
        let cost = |name: &str| self.units.as_ref().and_then(|c| c.median(name));
        let minus = |a: Option<units::Cost>, b: Option<units::Cost>, f: fn(&units::Cost) -> f64| {
            Some(f(&a?) - f(&b?))
        };
        // Round by round, so that the machine's drift between rounds falls out.
        let paired = |a: &str, b: &str, f: fn(&units::Cost) -> f64| {
            self.units.as_ref().and_then(|c| c.paired(a, b, f))
        };
        let trips = |c: &units::Cost| c.round_trips;
        let wal = |c: &units::Cost| c.wal;
        let cpu = |c: &units::Cost| c.cpu();
        let (u_bare, u_one) = (cost(units::BARE), cost(units::ONE_COMMIT));
        let trips_default = minus(cost(units::DEFAULT), u_bare, trips);
        let trips_one = minus(u_one, u_bare, trips);
        let wal_create = paired(units::DEFAULT, units::BARE, wal);
        let wal_one = paired(units::ONE_COMMIT, units::BARE, wal);
        let cpu_default = paired(units::DEFAULT, units::BARE, cpu);
        let cpu_one = paired(units::ONE_COMMIT, units::FULL_RECORD, cpu);
        let cpu_one_minimal = paired(units::ONE_COMMIT, units::EXPERIMENT, cpu);
        // A miss of the replay cache that says it is a retry, as the
        // crate's client does (the claim-first miss is a units row).
        let u_miss = cost(units::REPLAY_HINTED);
        // WAL a one-commit create writes beyond bare's, in key rows.
        let wal_one_extra = (|| Some((u_one?.wal - u_bare?.wal) / self.key_row_wal?))();
        let targets: [Target; 15] = [
            (
                format!("{which}: create >= 0.90 x bare"),
                ratio(at_commit, bare, tput),
                |v| v >= 0.90,
            ),
            (
                format!("{which}: open-loop p50 <= bare + 0.3 ms (ms over bare)"),
                open_gap,
                |v| v <= 0.3,
            ),
            (
                "default create >= 0.75 x bare".to_owned(),
                ratio(create, bare, tput),
                |v| v >= 0.75,
            ),
            (
                "default create p99 <= 1.3 x bare".to_owned(),
                ratio(create, bare, p99),
                |v| v <= 1.3,
            ),
            (
                "replay, cache hits >= 0.85 x the HTTP echo".to_owned(),
                ratio(replay, self.main(ECHO), tput),
                |v| v >= 0.85,
            ),
            (
                "one-commit create >= 0.93 x the full-record experiment".to_owned(),
                ratio(self.main(ONE_COMMIT), self.main(FULL_RECORD), tput),
                |v| v >= 0.93,
            ),
            (
                "one-commit create, trusted handlers >= 0.97 x the full-record experiment"
                    .to_owned(),
                ratio(self.main(TRUSTED), self.main(FULL_RECORD), tput),
                |v| v >= 0.97,
            ),
            (
                "default create >= 0.70 x the full-record experiment".to_owned(),
                ratio(create, self.main(FULL_RECORD), tput),
                |v| v >= 0.70,
            ),
            (
                "one-commit create observed >= 0.95 x unobserved".to_owned(),
                ratio(self.main(OBSERVED), self.main(ONE_COMMIT), tput),
                |v| v >= 0.95,
            ),
            (
                "create at 10 M keys >= 0.9 x at 0".to_owned(),
                growth,
                |v| v >= 0.9,
            ),
            (
                "default create: round trips = bare + 1 (over bare)".to_owned(),
                trips_default,
                |v| (v - 1.0).abs() < 0.05,
            ),
            (
                "one-commit create: round trips = bare's (over bare)".to_owned(),
                trips_one,
                |v| v.abs() < 0.05,
            ),
            (
                "one-commit create: CPU <= 1.05 x the full-record experiment's".to_owned(),
                cpu_one,
                |v| v <= 1.05,
            ),
            (
                "one-commit create: WAL over bare's, in key rows (<= 1.10; checkpoints' page images are the 0.10)".to_owned(),
                wal_one_extra,
                |v| v <= 1.10,
            ),
            (
                "default create: CPU over bare's (no target; read beside the above)".to_owned(),
                cpu_default,
                |_| true,
            ),
        ];
        println!();
        println!("| target | this run | met? |");
        println!("| --- | ---: | --- |");
        for (name, value, ok) in &targets {
            println!("| {name} | {} | {} |", fmt(*value), met(*value, *ok));
        }
        println!();
        if let (Some(experiment), Some(b), Some(c)) = (self.main(EXPERIMENT), bare, create) {
            println!(
                "claim at commit (experiment, end to end): {:.2} of bare, {:.2} of the layered create (ship gate: >= 1.15)",
                experiment.tput / b.tput,
                experiment.tput / c.tput
            );
        }
        if let (Some(mode), Some(b), Some(c)) = (self.main(ONE_COMMIT), bare, create) {
            println!(
                "one-commit mode (end to end): {:.2} of bare, {:.2} of the layered create",
                mode.tput / b.tput,
                mode.tput / c.tput
            );
        }
        if let (Some(typed), Some(c)) = (self.main(TYPED), create) {
            println!("typed unnamed statements: {:.2} of the default create (cached prepared statements)", typed.tput / c.tput);
        }
        if let (Some(five), Some(bare_five)) = (self.main(LAYERED_FIVE), self.main(BARE_FIVE)) {
            println!(
                "five statements: layered create {:.2} of bare, p99 {:.2} of bare",
                five.tput / bare_five.tput,
                five.p99 / bare_five.p99
            );
        }
        let full = self.main(FULL_RECORD);
        println!(
            "RATIOS onecommit_vs_experiment={} onecommit_trusted_vs_experiment={} default_vs_experiment={} \
             replay_hit_vs_echo={} replay_miss_roundtrips={} replay_miss_wal={} observed_vs_unobserved={} \
             roundtrips_default_minus_bare={} roundtrips_onecommit_minus_bare={} \
             onecommit_vs_minimal_experiment={} onecommit_4k_vs_experiment_4k={} create_vs_bare={} \
             p99_create_vs_bare={} mixed_vs_bare={} atcommit_vs_bare={} create_10m_vs_0={} \
             wal_create_vs_bare={} wal_onecommit_vs_bare={} cpu_default_vs_bare={} \
             cpu_onecommit_vs_experiment={} cpu_onecommit_vs_minimal_experiment={}",
            fmt(ratio(self.main(ONE_COMMIT), full, tput)),
            fmt(ratio(self.main(TRUSTED), full, tput)),
            fmt(ratio(create, full, tput)),
            fmt(ratio(replay, self.main(ECHO), tput)),
            fmt(u_miss.map(|c| c.round_trips)),
            fmt(u_miss.map(|c| c.wal)),
            fmt(ratio(self.main(OBSERVED), self.main(ONE_COMMIT), tput)),
            fmt(trips_default),
            fmt(trips_one),
            fmt(ratio(self.main(ONE_COMMIT), self.main(EXPERIMENT), tput)),
            fmt(ratio(self.main(ONE_COMMIT_4K), self.main(FULL_RECORD_4K), tput)),
            fmt(ratio(create, bare, tput)),
            fmt(ratio(create, bare, p99)),
            fmt(ratio(mixed, bare, tput)),
            fmt(ratio(at_commit, bare, tput)),
            fmt(growth),
            fmt(wal_create),
            fmt(wal_one),
            fmt(cpu_default),
            fmt(cpu_one),
            fmt(cpu_one_minimal),
        );
    }
}
