//! `cohort config` lists every COHORT_* variable with its value, default and
//! meaning, flags unusable values (and exits with 1), masks the secret; and
//! `cohort run` refuses an unusable value before any rank starts.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use cohort_runtime::config;
use common::{code, cohort_run, output_within, texts, COHORT};

/// `cohort config <args>` with no COHORT_* variable but `vars`.
fn cohort_config(args: &[&str], vars: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(COHORT);
    c.arg("config").args(args);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("COHORT_") {
            c.env_remove(name);
        }
    }
    c.envs(vars.iter().copied());
    c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let out = output_within(c, Duration::from_secs(30));
    let (stdout, stderr) = texts(&out);
    (code(out.status, &out), stdout, stderr)
}

#[test]
fn config_shows_every_variable_and_flags_unusable_values() {
    let (status, stdout, stderr) = cohort_config(
        &[],
        &[
            ("COHORT_TIMEOUT", "abc"),
            ("COHORT_CPU_DEVICES", "8"),
            ("COHORT_JOB_SECRET", "hunter2-secret"),
            ("COHORT_DISABLE_NCCL", "maybe"),
            ("COHORT_TIMOUT", "5"),
        ],
    );
    assert_eq!(status, 1, "{stdout}\n{stderr}");
    for setting in config::ALL.iter() {
        let d = setting.decl();
        assert!(stdout.contains(&format!("{} = ", d.name)), "{} missing:\n{stdout}", d.name);
        assert!(stdout.contains(&format!("default: {}", d.default)), "{} default missing", d.name);
        assert!(stdout.contains(d.meaning), "{} meaning missing", d.name);
    }
    assert!(
        stdout.contains("COHORT_TIMEOUT = \"abc\"\n    INVALID: it is not a number; expected a number of seconds"),
        "{stdout}"
    );
    assert!(stdout.contains("COHORT_DISABLE_NCCL = \"maybe\"\n    INVALID: it is not a switch"), "{stdout}");
    assert!(stdout.contains("COHORT_CPU_DEVICES = \"8\"\n    default: 4"), "{stdout}");
    assert!(stdout.contains("COHORT_WGPU_BACKEND = unset"), "{stdout}");
    assert!(stdout.contains("COHORT_JOB_SECRET = <hidden>") && !stdout.contains("hunter2"), "{stdout}");
    assert!(stdout.contains("COHORT_TIMOUT is set, but cohort reads no variable of that name"), "{stdout}");
    assert!(stderr.contains("2 variables are set to a value that cannot be used"), "{stderr}");

    let (status, stdout, stderr) = cohort_config(&[], &[("COHORT_TIMEOUT", "30"), ("COHORT_LOG", "info")]);
    assert_eq!(status, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("COHORT_TIMEOUT = \"30\"") && !stdout.contains("INVALID"), "{stdout}");

    // A log filter tracing cannot parse is flagged too.
    let (status, stdout, _) = cohort_config(&[], &[("COHORT_LOG", "cohort=loud")]);
    assert_eq!(status, 1);
    assert!(stdout.contains("COHORT_LOG = \"cohort=loud\"\n    INVALID: it is not a log filter"), "{stdout}");
}

#[test]
fn config_markdown_is_the_documented_table() {
    let (status, stdout, _) = cohort_config(&["--markdown"], &[]);
    assert_eq!(status, 0);
    assert_eq!(stdout, config::markdown_table());
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md")).unwrap();
    assert!(doc.contains(&stdout), "docs/configuration.md does not hold `cohort config --markdown`'s table");
}

#[test]
fn run_refuses_an_unusable_timeout_before_starting_ranks() {
    let mut c = cohort_run(&["-n", "2"], &["env"]);
    c.env("COHORT_TIMEOUT", "abc");
    let out = output_within(c, Duration::from_secs(30));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 1, "{stdout}\n{stderr}");
    assert!(stderr.contains("COHORT_TIMEOUT=\"abc\" cannot be used: it is not a number"), "{stderr}");
    assert!(!stdout.contains("RANK="), "a rank started: {stdout}");

    // --timeout replaces the inherited value, so the job runs.
    let mut c = cohort_run(&["-n", "1", "--timeout", "30"], &["env"]);
    c.env("COHORT_TIMEOUT", "abc");
    let out = output_within(c, Duration::from_secs(60));
    let (stdout, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("COHORT_TIMEOUT=30"), "{stdout}");
}

#[test]
fn an_unusable_log_filter_stops_the_launcher() {
    let mut c = cohort_run(&["-n", "1"], &["env"]);
    c.env("COHORT_LOG", "cohort=loud");
    let out = output_within(c, Duration::from_secs(30));
    let (_, stderr) = texts(&out);
    assert_eq!(code(out.status, &out), 2, "{stderr}");
    assert!(stderr.contains("COHORT_LOG=\"cohort=loud\""), "{stderr}");
}
