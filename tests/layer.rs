//! The layer's request flow against a real PostgreSQL: axum handlers that
//! answer `TxError` and take `Option<PgTx>`, the hyper and `ServiceBuilder`
//! examples as processes, the one-commit mode,
//! hardening against what a handler or an application does, hostile input,
//! replays rebuilt from a resource id, gRPC (trailers, `grpc-status`, the
//! key in the message; the tonic example called over HTTP/2), and the
//! completion's HOT update.

#[path = "layer/axum_answers.rs"]
mod axum_answers;
#[path = "layer/claim_at_commit.rs"]
mod claim_at_commit;
mod common;
#[path = "layer/fuzz_checks.rs"]
mod fuzz_checks;
#[path = "layer/grpc.rs"]
mod grpc;
#[path = "layer/grpc_codegen.rs"]
mod grpc_codegen;
#[path = "layer/grpc_orders.rs"]
mod grpc_orders;
#[path = "layer/hardening.rs"]
mod hardening;
#[path = "layer/hostile_input.rs"]
mod hostile_input;
#[path = "layer/hot_completion.rs"]
mod hot_completion;
#[path = "layer/http_examples.rs"]
mod http_examples;
#[path = "layer/on_paths.rs"]
mod on_paths;
#[path = "layer/resource_replay.rs"]
mod resource_replay;
#[path = "layer/retry_hint.rs"]
mod retry_hint;
