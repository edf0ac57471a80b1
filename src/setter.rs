//! How the crate's builders are written.

/// `value` with `set` applied: the body of a by-value setter
/// (`fn x(self, …) -> Self`).
pub(crate) fn with<T>(mut value: T, set: impl FnOnce(&mut T)) -> T {
    set(&mut value);
    value
}
