//! Ordering cohort's work with a stream another library owns:
//! [`Client::wait_external`] and [`Client::signal_external`].

#[allow(unused_imports)]
use super::Client;
