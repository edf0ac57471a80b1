//! Macros the middlewares share.

/// The `get_ref`, `get_mut` and `into_inner` of a middleware whose wrapped
/// service is the field `inner` of type `S` (as tower-http writes them).
macro_rules! define_inner_service_accessors {
    () => {
        /// Gets a reference to the wrapped service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// Gets a mutable reference to the wrapped service.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes the middleware, returning the wrapped service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

pub(crate) use define_inner_service_accessors;
