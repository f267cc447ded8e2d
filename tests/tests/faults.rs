//! Each step of a snapshot, a rollback, a restore and a fork made to fail in turn (planarian's
//! fault points, armed through /run/planarian/fault, fire once): the sandbox runs exactly as
//! before, no pending statepoint remains, a failed fork leaves nothing behind, and every
//! committed statepoint still restores.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;
use std::path::Path;

const FAULT: &str = "/run/planarian/fault";

fn inject(point: &str) {
    std::fs::create_dir_all(Path::new(FAULT).parent().unwrap()).unwrap();
    std::fs::write(FAULT, point).unwrap();
}

/// Disarms a fault that did not fire, whatever the test's outcome.
struct Disarm;
impl Drop for Disarm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(FAULT);
    }
}

/// The statepoint directories of a sandbox, each with its status ("none" without a manifest).
fn statepoint_dirs(sb: &Sandbox) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(sb.store().join("statepoints"))
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| {
                    let status = std::fs::read(e.path().join("manifest.json"))
                        .ok()
                        .and_then(|d| serde_json::from_slice::<serde_json::Value>(&d).ok())
                        .and_then(|m| m["status"].as_str().map(String::from))
                        .unwrap_or_else(|| "none".into());
                    (e.file_name().to_string_lossy().into_owned(), status)
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

/// The operation failed at `point`, the fault fired, and the sandbox runs on from `before`
/// (memory unchanged, counter + 1), with exactly the committed statepoints `committed`.
fn assert_unharmed(sb: &mut Sandbox, r: &Run, point: &str, before: &State, committed: &[&str]) -> State {
    assert_ne!(r.code, Some(0), "{point}: {r:?}");
    assert!(r.stderr.contains(&format!("injected fault at {point}")), "{point}: {r:?}");
    assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
    assert_eq!(
        podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(),
        "running",
        "{point}"
    );
    sb.seq = sb.read().expect("state readable").0;
    let now = sb.send("tick");
    assert_eq!(
        (now.counter, &now.checksum),
        (before.counter + 1, &before.checksum),
        "{point}: the sandbox is not as it was"
    );
    let mut want: Vec<(String, String)> = committed.iter().map(|s| (s.to_string(), "committed".to_string())).collect();
    want.sort();
    assert_eq!(statepoint_dirs(sb), want, "{point}: a pending or partial statepoint remains");
    now
}

#[test]
fn every_failing_step_of_snapshot_rollback_and_restore_leaves_the_sandbox_as_it_was() {
    require_stack!();
    let _d = Disarm;
    // The stop-and-restore path's steps (the rollback in place has its own, in inplace.rs).
    let mut sb = Sandbox::start("fault", 8, &["--annotation", "io.planarian.checkpoint.rollback_in_place=false"]);
    let at_sp = sb.send("tick");
    let sp = sb.snapshot("good");
    let mut before = sb.send("dirty 0 4096");
    for point in ["snapshot.before-freeze", "snapshot.frozen", "snapshot.dumped", "snapshot.before-commit"] {
        inject(point);
        let r = planarian(&["snapshot", &sb.name]);
        before = assert_unharmed(&mut sb, &r, point, &before, &[&sp]);
    }
    // CRIU's dumps that were discarded cleared soft-dirty bits: the next dump is full, not an
    // incremental one missing the pages written since the base.
    let sp2 = sb.snapshot("after-faults");
    assert!(sb.chain(&sp2)["full-reason"].as_str().unwrap_or("").contains("not committed"), "{}", sb.chain(&sp2));
    let at_sp2 = before.clone();
    // (rollback.files-restored fails in the branch restore.before-criu takes, the files undone and
    // the safety statepoint restored; atomic.rs makes it fail with a database beside it)
    for point in ["rollback.stopped", "restore.before-criu", "restore.restored", "rollback.restored"] {
        sb.sh("echo now > /root/f").ok();
        inject(point);
        let r = planarian(&["rollback", &sb.name, &sp]);
        assert!(
            r.stderr.contains("rollback failed, the container and its remote state are as they were before"),
            "{point}: {r:?}"
        );
        before = assert_unharmed(&mut sb, &r, point, &before, &[&sp, &sp2]);
        assert_eq!(sb.sh("cat /root/f").stdout, "now\n", "{point}: the files are not as they were");
    }
    // Every committed statepoint restores.
    for (target, state) in [(&sp, &at_sp), (&sp2, &at_sp2)] {
        sb.rollback(target);
        let back = sb.send("tick");
        assert_eq!((back.counter, &back.checksum), (state.counter + 1, &state.checksum), "{target}");
        assert_eq!(sb.sh("cat /root/f 2>/dev/null || echo none").stdout, "none\n", "{target}");
    }
    // A checkpoint that leaves (Podman's --export) and cannot hand its statepoint out does not
    // kill the container: the checkpoint fails, the sandbox runs on from where it was.
    sb.seq = sb.read().expect("state readable").0;
    let before = sb.send("tick");
    inject("checkpoint.handed-out");
    let r = podman("planarian", &["container", "checkpoint", "--export=/tmp/planarian-fault-export.tar.gz", &sb.name]);
    let _ = std::fs::remove_file("/tmp/planarian-fault-export.tar.gz");
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(!Path::new(FAULT).exists(), "the fault never fired");
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(), "running", "{r:?}");
    let now = sb.send("tick");
    assert_eq!((now.counter, &now.checksum), (before.counter + 1, &before.checksum));
}

#[test]
fn every_failing_step_of_a_fork_creates_nothing() {
    require_stack!();
    let _d = Disarm;
    let mut src = Sandbox::start("ffault", 8, &[]);
    let at_sp = src.send("tick");
    let sp = src.snapshot("fork-point");
    let before = src.send("dirty 0 4096");
    let stores = || std::fs::read_dir("/var/lib/planarian/containers").unwrap().filter_map(Result::ok).count();
    let (n_stores, n_containers) = (stores(), podman("planarian", &["ps", "-a", "-q"]).out().lines().count());
    let new = name("ffork");
    let _c = Cleanup(new.clone());
    for point in ["fork.cloned", "fork.linked", "restore.before-criu", "restore.restored"] {
        inject(point);
        let r = planarian(&["fork", &src.name, &sp, "--name", &new]);
        assert_ne!(r.code, Some(0), "{point}: {r:?}");
        assert!(
            r.stderr.contains("fork failed, nothing was created")
                && r.stderr.contains(&format!("injected fault at {point}")),
            "{point}: {r:?}"
        );
        assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
        assert_ne!(podman("planarian", &["inspect", &new]).code, Some(0), "{point}: the fork's container remains");
        assert_eq!(podman("planarian", &["ps", "-a", "-q"]).out().lines().count(), n_containers, "{point}");
        assert_eq!(stores(), n_stores, "{point}: the fork's store remains");
    }
    // The source ran on untouched, and the statepoint still forks.
    let now = src.send("tick");
    assert_eq!((now.counter, &now.checksum), (before.counter + 1, &before.checksum));
    planarian(&["fork", &src.name, &sp, "--name", &new]).ok();
    let f = Sandbox::attach(&new);
    assert_eq!(f.state(), at_sp);
}

/// An asynchronous snapshot that fails: the caller already had its id, `statepoint wait` says
/// why, no pending statepoint remains and the sandbox runs on unchanged.
#[test]
fn a_failing_async_snapshot_leaves_nothing_and_wait_says_why() {
    require_stack!();
    let _disarm = Disarm;
    let mut sb = Sandbox::start("async-fault", 8, &[]);
    let sp1 = sb.snapshot("kept");
    let before = sb.send("tick");
    inject("snapshot.frozen");
    let sp = planarian(&["snapshot", &sb.name, "--async"]).ok().out();
    let r = planarian(&["statepoint", "wait", &sb.name, &sp]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.stderr.contains("injected fault at snapshot.frozen"), "{r:?}");
    assert!(!Path::new(FAULT).exists(), "the fault never fired");
    assert_eq!(statepoint_dirs(&sb), vec![(sp1.clone(), "committed".to_string())]);
    let after = sb.send("tick");
    assert_eq!((after.counter, after.checksum.as_str()), (before.counter + 1, before.checksum.as_str()));
    // The next snapshot is a good one.
    let next = sb.snapshot("after");
    assert_eq!(sb.manifest(&next)["status"], "committed");
}
