//! The example order server run as a process against a throwaway
//! PostgreSQL: its HTTP contract (`contract`), the client layer against it,
//! the fulfilment, a crash soak, two instances on one database, a primary
//! failover, and its tables ready to shard by tenant.

#[path = "order_server/chaos.rs"]
mod chaos;
#[path = "order_server/client_order_server.rs"]
mod client_order_server;
mod common;
#[path = "order_server/contract.rs"]
mod contract;
#[path = "order_server/failover.rs"]
mod failover;
#[path = "order_server/fulfilment.rs"]
mod fulfilment;
#[path = "order_server/sharding.rs"]
mod sharding;
#[path = "order_server/two_instances.rs"]
mod two_instances;
