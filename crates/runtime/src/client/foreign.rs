//! Adopting foreign memory: [`Client::adopt`] and what gives it back (see
//! the `foreign` module).

#[allow(unused_imports)]
use super::Client;
