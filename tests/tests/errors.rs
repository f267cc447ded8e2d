//! Bad input gets a clear, one-line error and a non-zero exit, directly and through Podman.

use planarian_system_tests::*;
use std::path::Path;

#[test]
fn unknown_verb_missing_bundle_unknown_container() {
    require_stack!();
    for args in [
        &["frobnicate", "x"][..],
        &["create", "--bundle", "/nonexistent/bundle", "pltest-nobundle"][..],
        &["state", "pltest-no-such-container"][..],
        &["kill", "pltest-no-such-container", "15"][..],
    ] {
        let r = planarian(args);
        let c = cmd("crun", args);
        assert_ne!(r.code, Some(0), "{args:?}: {r:?}");
        // The pass-through gives crun's own answer.
        assert_eq!((r.code, &r.stderr), (c.code, &c.stderr), "{args:?}");
        assert!(!r.stderr.trim().is_empty(), "{args:?}: no error message");
    }
    let r = podman("planarian", &["start", "pltest-no-such-container"]);
    assert_ne!(r.code, Some(0));
    assert!(r.stderr.contains("no such container"), "{r:?}");
}

#[test]
fn calls_without_path_still_find_crun() {
    require_stack!();
    // Podman runs kill/delete/pause/resume with no PATH at all.
    let r = cmd("env", ["-i", "XDG_RUNTIME_DIR=", planarian_bin().to_str().unwrap(), "--version"]);
    r.ok();
    assert!(r.stdout.contains("crun version"), "{r:?}");
    let r = cmd("env", ["-i", planarian_bin().to_str().unwrap(), "list"]);
    r.ok();
    assert!(r.stdout.starts_with("NAME"), "{r:?}");
}

/// A misconfigured crun path: one clear line, a runc-style JSON line in Podman's log, and
/// Podman shows it to the user.
#[test]
fn missing_crun_is_one_clear_line_that_podman_shows() {
    require_stack!();
    let dropin = Path::new("/etc/planarian/planarian.conf.d/zz-test-missing-crun.conf");
    std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
    std::fs::write(dropin, "[runtime]\ncrun_path = \"/opt/no-such/crun\"\n").unwrap();
    struct Rm<'a>(&'a Path);
    impl Drop for Rm<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
        }
    }
    let _rm = Rm(dropin);

    let scratch = tempfile::tempdir().unwrap();
    let log = scratch.path().join("oci-log");
    let r = planarian(&["--log-format=json", "--log", log.to_str().unwrap(), "state", "x"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.lines().count(), 1, "{r:?}");
    assert!(r.stderr.starts_with("planarian: crun not found (looked in /opt/no-such/crun)"), "{r:?}");
    let line = std::fs::read_to_string(&log).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["level"], "error");
    assert!(v["msg"].as_str().unwrap().contains("/opt/no-such/crun"));
    assert!(v["time"].as_str().unwrap().ends_with('Z'));

    let n = name("nocrun");
    let _c = Cleanup(n.clone());
    let p = podman("planarian", &["run", "--name", &n, "--network", "none", BUSYBOX, "true"]);
    assert_ne!(p.code, Some(0));
    assert!(p.stderr.contains("crun not found"), "Podman did not show planarian's error: {p:?}");
}

#[test]
fn bad_configuration_names_the_file() {
    require_stack!();
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("planarian.conf");
    std::fs::write(&f, "[runtime]\ncrun = \"/usr/bin/crun\"\n").unwrap();
    let r = Command::new(planarian_bin()).env("PLANARIAN_CONFIG", &f).arg("list").output().unwrap();
    let r = Run::from(r);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains(f.to_str().unwrap()) && r.stderr.contains("crun"), "{r:?}");
}

use std::process::Command;

/// `planarian doctor` on the machine the suite runs on, which can run everything: every required
/// check passes, the cgroup freezer among them — also where planarian runs in the root cgroup,
/// which has no `cgroup.freeze` of its own (a fresh guest, a host without systemd: Debian 13's
/// 6.12 reported a failure there that was not one).
#[test]
fn doctor_passes_where_the_stack_runs() {
    require_stack!();
    let r = planarian(&["doctor", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {r:?}"));
    let checks = v["checks"].as_array().unwrap();
    let failed: Vec<&serde_json::Value> = checks.iter().filter(|c| c["status"] == "fail").collect();
    assert!(failed.is_empty() && v["ok"] == true && r.code == Some(0), "{failed:?} {r:?}");
    let cgroups = checks.iter().find(|c| c["name"] == "cgroups").expect("a cgroups check");
    assert_eq!(cgroups["status"], "pass", "{cgroups}");
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    eprintln!("doctor ran in cgroup {}: {}", own.trim(), cgroups["detail"]);
}
