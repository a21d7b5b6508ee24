//! Unit tests of the memory pools, against a fake [`PageStorage`] that checks
//! every page is freed exactly once.

mod demo;
mod fake;
mod modes;
mod props;
