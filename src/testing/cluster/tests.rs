use std::str::FromStr;

use super::*;
use crate::testing::database::{connect, tests::query_one};

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    rt.unwrap().block_on(future)
}

#[test]
fn temp_postgres_serves_queries_and_cleans_up() {
    let pg = TempPostgres::start().unwrap_or_else(|e| panic!("{e}"));
    let dir = pg.data_dir().parent().unwrap().to_path_buf();
    assert!(pg.data_dir().join("PG_VERSION").is_file());
    let parsed = tokio_postgres::Config::from_str(&pg.connection_string()).unwrap();
    block_on(async {
        for config in [pg.config(), parsed] {
            let client = connect(&config).await.unwrap();
            assert_eq!(query_one::<i32>(&client, "SELECT 1").await, 1);
            assert_eq!(query_one::<String>(&client, "SHOW fsync").await, "off");
        }
    });
    drop(pg);
    assert!(!dir.exists(), "{} should be removed on drop", dir.display());
}

#[test]
fn durable_builder_keeps_fsync_and_applies_settings() {
    let pg = TempPostgres::builder()
        .durable(true)
        .setting("work_mem", "8MB")
        .start();
    let pg = pg.unwrap_or_else(|e| panic!("{e}"));
    block_on(async {
        let client = connect(&pg.config()).await.unwrap();
        assert_eq!(query_one::<String>(&client, "SHOW fsync").await, "on");
        assert_eq!(query_one::<String>(&client, "SHOW work_mem").await, "8MB");
    });
}

#[test]
fn missing_binaries_message_says_what_to_install() {
    let msg = HarnessError::BinariesNotFound {
        searched: String::new(),
    }
    .to_string();
    assert!(msg.contains("apt-get install -y postgresql") && msg.contains("PG_BIN_DIR"));
}
