//! The messages and method paths of `orders.proto` (beside this file), as
//! prost derives: what `tonic-prost-build` generates from it, written out
//! so that the example builds without `protoc`.

/// The service's full name, as gRPC paths and reflection name it.
pub(crate) const SERVICE: &str = "orders.v1.Orders";
/// The path of `CreateOrder`.
pub(crate) const CREATE_ORDER: &str = "/orders.v1.Orders/CreateOrder";
/// The path of `GetOrder`.
pub(crate) const GET_ORDER: &str = "/orders.v1.Orders/GetOrder";

/// `orders.v1.CreateOrderRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct CreateOrderRequest {
    /// The operation's key (AIP-155), the same on every retry.
    #[prost(string, tag = "1")]
    pub(crate) request_id: String,
    #[prost(string, tag = "2")]
    pub(crate) sku: String,
    #[prost(uint32, tag = "3")]
    pub(crate) quantity: u32,
}

/// `orders.v1.GetOrderRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct GetOrderRequest {
    #[prost(string, tag = "1")]
    pub(crate) id: String,
}

/// `orders.v1.Order`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Order {
    #[prost(string, tag = "1")]
    pub(crate) id: String,
    #[prost(string, tag = "2")]
    pub(crate) sku: String,
    #[prost(uint32, tag = "3")]
    pub(crate) quantity: u32,
    /// In the currency's minor unit.
    #[prost(int64, tag = "4")]
    pub(crate) total: i64,
    /// RFC 3339, UTC.
    #[prost(string, tag = "5")]
    pub(crate) created_at: String,
}
