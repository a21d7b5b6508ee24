//! A `COHORT_*` variable that cannot be used is an error naming it, returned
//! by the constructor that reads it: `ClientGroup::new` and
//! `Communicator::connect` (`COHORT_TIMEOUT`, which neither read in silence
//! as 600 s nor panic on any more; `COHORT_FLIGHT_RECORDER`,
//! `COHORT_FUSION_MB`), `CpuRuntime::client` (`COHORT_CPU_DEVICES`).
//!
//! One test: the environment is the process's, so the cases run in order.

use cohort_comm::{ClientGroup, CommError, Communicator, ConnectError};
use cohort_runtime::{CpuRuntime, Runtime, ServerError};

#[test]
fn unusable_values_are_errors_naming_the_variable() {
    let clients: Vec<_> = (0..2).map(|i| CpuRuntime::client(i).expect("a CPU device")).collect();

    for bad in ["abc", "1e30", "1.8e19", "inf", "nan", "-3", "0"] {
        std::env::set_var("COHORT_TIMEOUT", bad);
        let err = ClientGroup::new(clients.clone()).expect_err(bad);
        assert!(matches!(err, CommError::Variable(_)), "{bad}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&format!("COHORT_TIMEOUT=\"{bad}\"")) && msg.contains("seconds"), "{bad}: {msg}");

        // Fails before it tries to reach the (absent) store.
        let err = Communicator::connect(0, 1, "127.0.0.1:9", "secret", clients.clone()).expect_err(bad);
        assert!(matches!(err, ConnectError::Variable(_)), "{bad}: {err:?}");
        assert!(err.to_string().contains("COHORT_TIMEOUT"), "{bad}: {err}");
    }

    std::env::set_var("COHORT_TIMEOUT", "2.5");
    let group = ClientGroup::new(clients.clone()).expect("a valid timeout");
    assert_eq!(group.timeout(), std::time::Duration::from_millis(2500));
    std::env::remove_var("COHORT_TIMEOUT");
    assert_eq!(ClientGroup::new(clients.clone()).unwrap().timeout(), cohort_comm::DEFAULT_TIMEOUT);

    std::env::set_var("COHORT_FLIGHT_RECORDER", "lots");
    let err = ClientGroup::new(clients.clone()).expect_err("an unusable recorder size");
    assert!(err.to_string().contains("COHORT_FLIGHT_RECORDER=\"lots\""), "{err}");
    std::env::remove_var("COHORT_FLIGHT_RECORDER");

    for bad in ["lots", "-1", "1.5"] {
        std::env::set_var("COHORT_FUSION_MB", bad);
        let err = ClientGroup::new(clients.clone()).expect_err("an unusable fusion cap");
        assert!(err.to_string().contains(&format!("COHORT_FUSION_MB=\"{bad}\"")), "{err}");
        let err = Communicator::connect(0, 1, "127.0.0.1:9", "secret", clients.clone()).expect_err(bad);
        assert!(err.to_string().contains("COHORT_FUSION_MB"), "{bad}: {err}");
    }
    std::env::set_var("COHORT_FUSION_MB", "0");
    ClientGroup::new(clients.clone()).expect("0 turns fusion off");
    std::env::remove_var("COHORT_FUSION_MB");

    std::env::set_var("COHORT_TRANSPORT", "carrier-pigeon");
    let err = Communicator::from_env(clients.clone()).expect_err("an unusable transport");
    assert!(err.to_string().contains("COHORT_TRANSPORT=\"carrier-pigeon\""), "{err}");
    std::env::remove_var("COHORT_TRANSPORT");

    // torchrun-style start-up variables: an address that names no host is
    // one error naming MASTER_ADDR and its value once the name has been
    // looked up for the grace (60 s at most, never past COHORT_TIMEOUT:
    // here 1 s), not a wait for a store that cannot be reached.
    std::env::set_var("COHORT_TIMEOUT", "1");
    std::env::set_var("COHORT_JOB_SECRET", "0123456789abcdef0123456789abcdef");
    std::env::set_var("WORLD_SIZE", "2");
    std::env::set_var("MASTER_PORT", "29999");
    for rank in ["1", "0"] {
        std::env::set_var("RANK", rank);
        for bad in ["not a host!", "no-such-host.invalid", "999.1.1.1"] {
            std::env::set_var("MASTER_ADDR", bad);
            let started = std::time::Instant::now();
            let err = Communicator::from_env(clients.clone()).expect_err(bad);
            assert!(
                started.elapsed() < std::time::Duration::from_secs(30),
                "rank {rank}, {bad}: waited {:?}",
                started.elapsed()
            );
            assert!(err.to_string().contains(&format!("MASTER_ADDR=\"{bad}\"")), "rank {rank}: {err}");
        }
    }
    // A world larger than any job (2^32 + 2 would reach the store's
    // barriers as 2 ranks; every rank sizes tables by it): refused before
    // any waiting, whether passed or read from WORLD_SIZE.
    let started = std::time::Instant::now();
    let err = Communicator::connect(0, 1 << 40, "127.0.0.1:9", "secret", clients.clone()).expect_err("a huge world");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "waited {:?}", started.elapsed());
    assert!(err.to_string().contains("world size 1099511627776"), "{err}");
    // Out of range or unusable: one error naming the variable and value.
    std::env::set_var("MASTER_ADDR", "127.0.0.1");
    for (rank, world, port, named) in [
        ("2", "2", "29999", "RANK=2"),
        ("0", "0", "29999", "WORLD_SIZE=0"),
        ("-1", "2", "29999", "RANK=\"-1\""),
        ("18446744073709551616", "2", "29999", "RANK=\"18446744073709551616\""),
        ("0", "two", "29999", "WORLD_SIZE=\"two\""),
        ("0", "2", "0", "MASTER_PORT=\"0\""),
        ("0", "2", "70000", "MASTER_PORT=\"70000\""),
        ("0", "4294967298", "29999", "WORLD_SIZE=4294967298"),
    ] {
        std::env::set_var("RANK", rank);
        std::env::set_var("WORLD_SIZE", world);
        std::env::set_var("MASTER_PORT", port);
        let started = std::time::Instant::now();
        let err = Communicator::from_env(clients.clone()).expect_err(named);
        assert!(err.to_string().contains(named), "{named}: {err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "{named}: waited {:?}", started.elapsed());
    }
    for v in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "COHORT_JOB_SECRET", "COHORT_TIMEOUT"] {
        std::env::remove_var(v);
    }

    std::env::set_var("COHORT_CPU_DEVICES", "four");
    let err = CpuRuntime::client(0).expect_err("an unusable device count");
    assert!(matches!(err, ServerError::Variable(_)), "{err:?}");
    assert!(err.to_string().contains("COHORT_CPU_DEVICES=\"four\""), "{err}");
    std::env::remove_var("COHORT_CPU_DEVICES");
}
