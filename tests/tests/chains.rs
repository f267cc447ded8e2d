//! Algorithm 1 through the whole product: statepoints of a container stay incremental across
//! rollback and the full-dump interval, memory is exact after every restore, a process that
//! reuses a PID after a restore is dumped in full, and a failed pre-resume hook costs a full dump,
//! never a corrupt one. Pages come from CRIU's own stats, recorded in each manifest.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;

/// The sandboxes hold 32 MiB: 8192 pages. An incremental dump of a 64 KiB change writes a few
/// pages, or one or two transparent huge pages (512 pages each: soft-dirty is tracked per PMD),
/// plus Python's heap. (Big enough to tell the two apart; small enough to be quick under emulation.)
const MIB: u32 = 32;
const FULL: u64 = 8_192;
const INCREMENTAL: u64 = 2_048;

fn assert_incremental(sb: &Sandbox, sp: &str, depth: u64) {
    sb.assert_incremental(sp, depth, INCREMENTAL);
}

fn assert_full(sb: &Sandbox, sp: &str, why: &str) {
    sb.assert_full(sp, why, FULL);
}

fn chain(sb: &Sandbox, sp: &str) -> serde_json::Value {
    sb.chain(sp)
}

#[test]
fn dumps_stay_incremental_across_rollback_and_the_full_dump_interval() {
    require_stack!();
    let mut sb = Sandbox::start("inc", MIB, &["--annotation", "io.planarian.checkpoint.full_dump_interval=3"]);
    let s1 = sb.send("tick");
    let sp1 = sb.snapshot("a1");
    assert_full(&sb, &sp1, "first statepoint");

    sb.send("dirty 1048576 65536");
    let s2 = sb.send("tick");
    let sp2 = sb.snapshot("a2");
    assert_incremental(&sb, &sp2, 1);
    assert_eq!(chain(&sb, &sp2)["prev-images-dir"], format!("../../{sp1}/criu"));

    // The first dump after a rollback builds on the restored statepoint.
    sb.rollback(&sp1);
    assert_eq!(sb.send("tick").checksum, s1.checksum, "memory after rollback to {sp1}");
    sb.send("dirty 9437184 65536");
    let s3 = sb.send("tick");
    let sp3 = sb.snapshot("a3");
    assert_incremental(&sb, &sp3, 1);
    assert!(chain(&sb, &sp3)["prev-images-dir"].as_str().unwrap().contains("bases/"), "{}", chain(&sb, &sp3));

    sb.rollback(&sp2);
    assert_eq!(sb.send("tick").checksum, s2.checksum, "memory after rollback to {sp2}");
    sb.send("dirty 20971520 65536");
    let s4 = sb.send("tick");
    let sp4 = sb.snapshot("a4");
    assert_incremental(&sb, &sp4, 2);

    // k = 3: the fourth dump of the chain is full.
    sb.send("dirty 0 4096");
    let sp5 = sb.snapshot("a5");
    assert_full(&sb, &sp5, "interval");

    // Every statepoint restores exactly, through bases and chains.
    // (sp1, the full dump, was restored above)
    for (sp, st) in [(&sp3, &s3), (&sp4, &s4)] {
        sb.rollback(sp);
        assert_eq!(sb.send("tick").checksum, st.checksum, "memory after rollback to {sp}");
    }

    // Removing sp2 from the middle of sp4's chain keeps sp4 restorable.
    cmd(planarian_bin().to_str().unwrap(), ["statepoint", "rm", &sb.name, &sp2]).ok();
    sb.send("dirty 0 1000000");
    sb.rollback(&sp4);
    assert_eq!(sb.send("tick").checksum, s4.checksum, "memory after rollback to {sp4} without {sp2}");
    // sp4 is at depth 2: the next dump would be the chain's fourth, so it is full.
    let sp6 = sb.snapshot("a6");
    assert_full(&sb, &sp6, "interval");
}

#[test]
fn a_process_reusing_a_pid_after_restore_is_dumped_in_full() {
    require_stack!();
    // The workload picks its child's PID through ns_last_pid, which needs CAP_SYS_ADMIN in the
    // container and a writable /proc/sys.
    let mut sb = Sandbox::start("pidreuse", 16, &["--cap-add", "SYS_ADMIN", "--security-opt", "unmask=/proc/sys"]);
    sb.send("fork 1 100");
    let (pid_a, sum_a) = sb.child();
    assert_eq!(pid_a, 100);
    let sp1 = sb.snapshot("with-a");
    sb.rollback(&sp1);
    assert_eq!(sb.child(), (100, sum_a.clone()), "the child restores exactly");

    // After the restore, a new child forked without exec gets the same PID 100, with different
    // memory. CRIU must see that it started after the base (E) and dump it in full: taken from
    // the parent images, its pages would be child A's.
    sb.send("reap");
    sb.send("fork 2 100");
    let (pid_b, sum_b) = sb.child();
    assert_eq!(pid_b, 100);
    assert_ne!(sum_b, sum_a);
    let st = sb.send("tick");
    let sp2 = sb.snapshot("with-b");
    assert!(chain(&sb, &sp2)["prev-images-dir"].is_string(), "{}", chain(&sb, &sp2));
    sb.send("reap");
    sb.send("dirty 0 1000000");
    sb.rollback(&sp2);
    assert_eq!(sb.child(), (100, sum_b), "the child that reused PID 100 restores with its own memory");
    assert_eq!(sb.send("tick").checksum, st.checksum);
}

#[test]
fn a_failed_pre_resume_hook_makes_the_next_dump_full_not_corrupt() {
    require_stack!();
    // The hook runs on a restore: this sandbox's rollbacks stop and restore.
    let mut sb = Sandbox::start("hookfail", MIB, &["--annotation", "io.planarian.checkpoint.rollback_in_place=false"]);
    let sp1 = sb.snapshot("h1");
    let scratch = tempfile::tempdir().unwrap();
    let script = scratch.path().join("hook");
    std::fs::write(&script, "#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = pre-resume ] && exit 1\nexit 0\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let _dropin =
        DropIn::new("zz-test-failing-hook", &format!("[runtime]\ncriu_hooks_path = \"{}\"\n", script.display()));
    sb.rollback(&sp1);
    let st = sb.send("dirty 1048576 65536");
    let sp2 = sb.snapshot("h2");
    assert_full(&sb, &sp2, "recorded no epoch");
    drop(_dropin);
    sb.send("dirty 0 1000000");
    sb.rollback(&sp2);
    assert_eq!(sb.send("tick").checksum, st.checksum);
    // With the hook back, the dump after this restore is incremental again.
    sb.send("dirty 4194304 65536");
    let sp3 = sb.snapshot("h3");
    assert_incremental(&sb, &sp3, 1);
}

#[test]
fn a_podman_pre_checkpoint_makes_the_next_dump_full_not_corrupt() {
    require_stack!();
    // CRIU's pre-dump clears the soft-dirty bits: what was written before it is in the pre-dump
    // only. A dump incremental on the statepoint before would miss it.
    let mut sb = Sandbox::start("predump", MIB, &[]);
    sb.snapshot("p1");
    sb.send("dirty 1048576 65536");
    podman("planarian", &["container", "checkpoint", "--pre-checkpoint", &sb.name]).ok();
    sb.send("dirty 4194304 65536");
    let st = sb.send("tick");
    let sp2 = sb.snapshot("p2");
    assert_full(&sb, &sp2, "pre-dump");
    sb.send("dirty 0 1000000");
    sb.rollback(&sp2);
    assert_eq!(sb.send("tick").checksum, st.checksum, "the memory of both writes is back");
}

#[test]
fn an_incremental_dump_criu_refuses_is_retried_in_full() {
    require_stack!();
    let mut sb = Sandbox::start("retry", 16, &[]);
    let sp1 = sb.snapshot("r1");
    sb.rollback(&sp1);
    // Damage the base the next dump builds on (the rollback's own copy of sp1's inventory, not
    // sp1 itself): CRIU then refuses the incremental dump ("no parent inventory").
    let id = sb.id();
    let dir = std::path::Path::new("/var/lib/planarian/containers").join(&id);
    let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("base")).unwrap()).unwrap();
    let images = dir.join(base["images"].as_str().unwrap());
    assert!(images.starts_with(dir.join("bases")), "{}", images.display());
    std::fs::write(images.join("inventory.img"), b"bad").unwrap();
    let st = sb.send("dirty 1048576 65536");
    let sp2 = sb.snapshot("r2");
    let c = sb.chain(&sp2);
    assert!(
        c["prev-images-dir"].is_null() && c["full-reason"].as_str().unwrap().contains("incremental dump failed"),
        "{c}"
    );
    assert!(dir.join("statepoints").join(&sp2).join("dump-incremental-failed.log").exists());
    // The full dump is a good statepoint.
    sb.send("dirty 0 1000000");
    sb.rollback(&sp2);
    assert_eq!(sb.send("tick").checksum, st.checksum);
}

/// `planarian snapshot CTR --name NAME`: the statepoint's id.
fn snap(ctr: &str, name: &str) -> String {
    planarian(&["snapshot", ctr, "--name", name]).ok().out()
}

fn manifest_of(ctr: &str, sp: &str) -> serde_json::Value {
    let r = planarian(&["statepoint", "list", ctr, "--json"]);
    let list: Vec<serde_json::Value> = serde_json::from_str(&r.ok().stdout).unwrap();
    list.into_iter().find(|m| m["statepoint-id"] == sp).unwrap_or_else(|| panic!("no {sp}"))
}

/// The inodes of a statepoint's memory images (pages and page maps).
fn image_inodes(ctr: &str, sp: &str) -> Vec<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let id = podman("planarian", &["inspect", "--format", "{{.Id}}", ctr]).ok().out();
    let dir = std::path::Path::new("/var/lib/planarian/containers").join(id).join("statepoints").join(sp).join("criu");
    let mut v: Vec<(String, u64)> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.metadata().unwrap().ino()))
        .filter(|(n, _)| n.starts_with("pages-") || n.starts_with("pagemap-"))
        .collect();
    v.sort();
    v
}

/// What statepoint `sp` recorded of its tree beside its memory images (`unchanged.json`), and
/// that file's inode.
fn record_of(ctr: &str, sp: &str) -> (serde_json::Value, u64) {
    use std::os::unix::fs::MetadataExt;
    let id = podman("planarian", &["inspect", "--format", "{{.Id}}", ctr]).ok().out();
    let f = std::path::Path::new("/var/lib/planarian/containers")
        .join(id)
        .join("statepoints")
        .join(sp)
        .join("criu/unchanged.json");
    let text = std::fs::read(&f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    (serde_json::from_slice(&text).unwrap(), std::fs::metadata(&f).unwrap().ino())
}

/// Why planarian's log says statepoint `sp` took a memory dump.
fn why_dumped(sp: &str) -> String {
    let log = std::fs::read_to_string("/var/log/planarian.log").unwrap_or_default();
    let key = format!("statepoint {sp}: a memory dump");
    log.lines().filter(|l| l.contains(&key)).collect::<Vec<_>>().join(" / ")
}

#[test]
fn a_statepoint_of_a_sandbox_that_did_nothing_takes_no_dump() {
    require_stack!();
    // A sandbox whose one process waits and does nothing, as an agent's between tool calls: it
    // waits for a writer to open a FIFO. (A `sleep` would not do: each freeze makes the kernel
    // write the time left into its memory.)
    let n = name("idle");
    let _c = Cleanup(n.clone());
    podman(
        "planarian",
        &["run", "-d", "--name", &n, "--network", "none", BUSYBOX, "sh", "-c", "mkfifo /tmp/p && exec cat /tmp/p"],
    )
    .ok();
    // Until it waits in openat (syscall 257) for a writer.
    let pid = podman("planarian", &["inspect", "--format", "{{.State.Pid}}", &n]).ok().out();
    let syscall = format!("/proc/{pid}/syscall");
    assert!(
        wait_for(std::time::Duration::from_secs(60), || std::fs::read_to_string(&syscall)
            .is_ok_and(|s| s.starts_with("257 "))),
        "the sandbox's process does not wait: {:?}",
        std::fs::read_to_string(&syscall)
    );
    let a = snap(&n, "a");
    assert_eq!(manifest_of(&n, &a)["chain"]["same-as"], serde_json::Value::Null);
    let b = snap(&n, "b");
    let mb = manifest_of(&n, &b);
    assert_eq!(mb["chain"]["same-as"], a.as_str(), "nothing ran: no dump ({}; {mb})", why_dumped(&b));
    assert_eq!(image_inodes(&n, &b), image_inodes(&n, &a), "b's memory images are a's (hard links)");
    assert!(!image_inodes(&n, &a).is_empty());
    // b records what it saw of the tree, in a file of its own (the next statepoint compares with
    // b, one thaw since, not with a: a thaw may count a tick of user time), a's left as it was.
    let (ra, rb) = (record_of(&n, &a), record_of(&n, &b));
    assert_ne!(ra.1, rb.1, "b's record is its own file");
    assert_eq!(ra.0["fingerprint"], rb.0["fingerprint"]);
    let times = |r: &serde_json::Value| r["user-time"].as_object().cloned().unwrap_or_default();
    assert!(!times(&rb.0).is_empty(), "b recorded user times: {}", rb.0);
    for (pid, t) in times(&ra.0) {
        assert!(times(&rb.0)[&pid].as_u64() >= t.as_u64(), "{pid}: b's time is not before a's");
    }

    // A command that came and went and wrote a file: the processes still did nothing, and the
    // file is in the statepoint.
    podman("planarian", &["exec", &n, "sh", "-c", "echo one > /f"]).ok();
    let c = snap(&n, "c");
    let mc = manifest_of(&n, &c);
    assert!(
        [a.as_str(), b.as_str()].contains(&mc["chain"]["same-as"].as_str().unwrap_or("-")),
        "{}; {mc}",
        why_dumped(&c)
    );

    // One that writes to the process's own output (a pipe it holds): that is a change, dumped.
    podman("planarian", &["exec", &n, "sh", "-c", "echo to-the-log > /proc/1/fd/1"]).ok();
    let d = snap(&n, "d");
    let md = manifest_of(&n, &d);
    assert_eq!(md["chain"]["same-as"], serde_json::Value::Null, "a real dump: {md}");
    assert_ne!(image_inodes(&n, &d), image_inodes(&n, &a));

    // The statepoints taken without a dump restore as any other, also once the one whose
    // images they share is gone.
    let status = || podman("planarian", &["inspect", "--format", "{{.State.Status}}", &n]).out();
    let file = || podman("planarian", &["exec", &n, "cat", "/f"]);
    planarian(&["rollback", &n, &b]).ok();
    assert_eq!(status(), "running");
    assert_ne!(file().code, Some(0), "b has no /f");
    planarian(&["statepoint", "rm", &n, &a, &b]).ok();
    planarian(&["rollback", &n, &c]).ok();
    assert_eq!(status(), "running");
    assert_eq!(file().ok().out(), "one");
    let pid1 = podman("planarian", &["exec", &n, "cat", "/proc/1/cmdline"]).ok().stdout.clone();
    assert_eq!(pid1, "cat\u{0}/tmp/p\u{0}", "the sandbox's process is back");
}
