//! Derived downstream idempotency keys.

use sha2::{Digest, Sha256};

/// A stable idempotency key for one downstream operation on one entity.
///
/// `derive_key(order_id, "payment.charge")` is the same string on every
/// redelivery of the event, in every process, forever, so the downstream API
/// (itself idempotent) performs the charge once however often it is asked.
/// Two operations on one entity (`payment.charge`, `inventory.reserve`) get
/// two different keys.
///
/// The key is `dk1-` followed by 40 hex digits of
/// `SHA-256("tower-idempotency/derived/1" ‖ len(id) ‖ id ‖ operation)`: visible
/// ASCII, 44 characters, free of the entity id's own characters. Derive from
/// the event id instead when one entity emits several events that each need
/// their own effect for the same operation.
///
/// ```
/// use tower_idempotency::outbox::derive_key;
///
/// let charge = derive_key("5f0c…order-id", "payment.charge");
/// assert_eq!(charge, derive_key("5f0c…order-id", "payment.charge"));
/// assert_ne!(charge, derive_key("5f0c…order-id", "inventory.reserve"));
/// assert!(charge.starts_with("dk1-") && charge.len() == 44);
/// ```
pub fn derive_key(entity_id: &str, operation: &str) -> String {
    derive(b"tower-idempotency/derived/1", &[entity_id], operation)
}

/// [`derive_key`] for an entity whose id is unique only within its tenant
/// (order number `1001` in two tenants): the tenant is part of the key, so
/// two tenants' entities never share one. It is the key
/// [`OutboxEvent::derived_key`](super::OutboxEvent::derived_key) gives, and
/// never equals a [`derive_key`] (another domain string goes into the hash).
///
/// ```
/// use tower_idempotency::outbox::{derive_key, derive_tenant_key};
///
/// let a = derive_tenant_key("tenant-a", "1001", "payment.charge");
/// assert_ne!(a, derive_tenant_key("tenant-b", "1001", "payment.charge"));
/// assert_ne!(a, derive_key("1001", "payment.charge"));
/// assert!(a.starts_with("dk1-") && a.len() == 44);
/// ```
pub fn derive_tenant_key(tenant_id: &str, entity_id: &str, operation: &str) -> String {
    derive(
        b"tower-idempotency/derived-in-tenant/1",
        &[tenant_id, entity_id],
        operation,
    )
}

/// `dk1-` and 40 hex digits of `SHA-256(domain ‖ (len(part) ‖ part)… ‖
/// operation)`.
fn derive(domain: &[u8], parts: &[&str], operation: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(domain);
    for part in parts {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    hasher.update(operation.as_bytes());
    let digest = hasher.finalize();
    let hex: String = digest[..20].iter().map(|b| format!("{b:02x}")).collect();
    format!("dk1-{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_between_id_and_operation_matter() {
        assert_ne!(derive_key("ab", "c"), derive_key("a", "bc"));
    }

    #[test]
    fn a_key_in_a_tenant_is_its_own() {
        let in_a = derive_tenant_key("tenant-a", "1001", "payment.charge");
        assert_ne!(
            in_a,
            derive_tenant_key("tenant-b", "1001", "payment.charge")
        );
        assert_ne!(in_a, derive_key("1001", "payment.charge"));
        assert_ne!(
            derive_tenant_key("ab", "c", "op"),
            derive_tenant_key("a", "bc", "op")
        );
        assert!(crate::key::IdempotencyKey::parse(in_a.as_bytes()).is_ok());
    }

    #[test]
    fn is_a_valid_idempotency_key() {
        let key = derive_key("order-1", "payment.charge");
        assert!(crate::key::IdempotencyKey::parse(key.as_bytes()).is_ok());
    }
}
