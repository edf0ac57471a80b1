//! The messages, the client and the server `tonic-prost-build` generates
//! from `orders.proto` (beside this file): `orders.v1.rs`, kept as
//! generated so that the example builds without `protoc`. A service of
//! your own would generate it in its build script with
//! `tonic_prost_build::compile_protos("proto/orders.proto")` and
//! `tonic::include_proto!("orders.v1")`.

// Generated code, as generated: public items in a private module.
#![allow(unreachable_pub)]

include!("orders.v1.rs");

/// The path of `CreateOrder`: the one method the idempotency layer guards.
pub(crate) const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";
