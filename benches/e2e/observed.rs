//! The observed variant: a tracing subscriber at `INFO` formatting every
//! event to a sink, and the Prometheus recorder, as a service runs in
//! production. Installed once for the whole process but off (events
//! filtered out at their call sites, metrics to no-op handles) except
//! while an observed scenario runs, so that the other scenarios run as
//! without them.

use std::sync::{
    atomic::{AtomicBool, Ordering},
    OnceLock,
};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use tracing_subscriber::{filter::LevelFilter, layer::SubscriberExt as _, reload, Registry};

static ON: AtomicBool = AtomicBool::new(false);

type Filter = reload::Handle<LevelFilter, Registry>;

struct Installed {
    filter: Filter,
    prometheus: PrometheusHandle,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

/// Installs the subscriber and the recorder, both off.
pub(crate) fn install() {
    INSTALLED.get_or_init(|| {
        let (filter, handle) = reload::Layer::new(LevelFilter::OFF);
        let subscriber = tracing_subscriber::registry().with(filter).with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::sink)
                .with_ansi(false),
        );
        tracing::subscriber::set_global_default(subscriber).expect("a subscriber");
        let recorder = PrometheusBuilder::new().build_recorder();
        let prometheus = recorder.handle();
        metrics::set_global_recorder(Toggled(recorder)).expect("a recorder");
        Installed {
            filter: handle,
            prometheus,
        }
    });
}

/// Observing while held.
pub(crate) struct On(());

impl On {
    pub(crate) fn new() -> On {
        let installed = INSTALLED.get().expect("observed::install first");
        installed
            .filter
            .modify(|f| *f = LevelFilter::INFO)
            .expect("reload");
        ON.store(true, Ordering::SeqCst);
        On(())
    }
}

impl Drop for On {
    fn drop(&mut self) {
        ON.store(false, Ordering::SeqCst);
        if let Some(installed) = INSTALLED.get() {
            let _ = installed.filter.modify(|f| *f = LevelFilter::OFF);
            // What a scrape renders, so that the recorder's work is real.
            let _ = installed.prometheus.render();
        }
    }
}

/// The Prometheus recorder, handing out its handles only while on.
struct Toggled(PrometheusRecorder);

impl Recorder for Toggled {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_counter(key, unit, description);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_gauge(key, unit, description);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.0.describe_histogram(key, unit, description);
    }
    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        if ON.load(Ordering::Relaxed) {
            self.0.register_counter(key, metadata)
        } else {
            Counter::noop()
        }
    }
    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        if ON.load(Ordering::Relaxed) {
            self.0.register_gauge(key, metadata)
        } else {
            Gauge::noop()
        }
    }
    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        if ON.load(Ordering::Relaxed) {
            self.0.register_histogram(key, metadata)
        } else {
            Histogram::noop()
        }
    }
}
