//! Statepoints through plain Podman and `planarian rollback`, asserting real state: a memory
//! checksum and a counter inside the sandbox, file contents, and what Podman reports.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;
use std::path::Path;
use std::time::Duration;

#[test]
fn rollback_restores_memory_checksum_and_counter() {
    require_stack!();
    let mut sb = Sandbox::start("mem", 16, &[]);
    sb.send("tick");
    let at_sp = sb.send("tick");
    assert_eq!(at_sp.counter, 2);
    let sp = sb.snapshot("two-ticks");
    sb.send("tick");
    let dirty = sb.send("dirty 1048576 65536");
    assert_eq!(dirty.counter, 3);
    assert_ne!(dirty.checksum, at_sp.checksum);

    sb.rollback(&sp);
    assert_eq!(sb.state(), at_sp, "the published state is the statepoint's");
    // The live process recomputes its checksum from memory: it must be the statepoint's.
    let after = sb.send("tick");
    assert_eq!(after.counter, 3, "the counter continues from the statepoint");
    assert_eq!(after.checksum, at_sp.checksum, "memory is exactly the statepoint's");
    // Rolling back twice to the same statepoint works too.
    sb.send("dirty 0 4096");
    sb.rollback(&sp);
    let again = sb.send("tick");
    assert_eq!((again.counter, &again.checksum), (3, &at_sp.checksum));
    // Podman's tooling still works on the restored container.
    assert!(sb.exec("echo exec-ok").stdout.contains("exec-ok"));
    podman("planarian", &["pause", &sb.name]).ok();
    podman("planarian", &["unpause", &sb.name]).ok();
    podman("planarian", &["stop", "-t", "0", &sb.name]).ok();
    podman("planarian", &["rm", &sb.name]).ok();
}

#[test]
fn rollback_makes_files_exactly_what_they_were() {
    require_stack!();
    let mut sb = Sandbox::start("files", 8, &[]);
    sb.sh("mkdir -p /work/src && echo v1 > /work/src/main.py && echo conf-v1 > /etc/app.conf").ok();
    let listing = "find /work /etc/app.conf /etc/debian_version /etc/motd /opt -maxdepth 3 2>/dev/null | sort; cat /work/src/main.py /etc/app.conf /etc/debian_version 2>&1";
    let at_sp = sb.sh(listing).stdout;
    let sp = sb.snapshot("files-v1");
    // New files, new directories, modified files, deleted and overwritten image files.
    sb.sh("echo v2 > /work/src/main.py; mkdir -p /opt/new/deep && echo x > /opt/new/deep/f; echo junk > /etc/motd; rm /etc/debian_version; echo conf-v2 > /etc/app.conf; rm -rf /work/src").ok();
    assert_ne!(sb.sh(listing).stdout, at_sp);
    sb.rollback(&sp);
    assert_eq!(sb.sh(listing).stdout, at_sp);
    // /etc/motd of the image was overwritten after the statepoint: back to the image's content.
    assert_ne!(sb.sh("cat /etc/motd").stdout, "junk\n");
}

#[test]
fn rollback_restores_dev_and_masked_directories_exactly() {
    require_stack!();
    let mut sb = Sandbox::start("dev", 8, &[]);
    // What an agent can leave in /dev: a file (and a hard link to it), a directory, a FIFO (its
    // tool calls are execs; what the test reads, it reads in the namespaces: Sandbox::sh).
    sb.exec("echo kept > /dev/agent-note && chmod 640 /dev/agent-note && mkdir /dev/sub && ln /dev/agent-note /dev/sub/hl && mkfifo /dev/ff").ok();
    // Every entry of the /dev tmpfs (not the mounts on it): name, type, mode, owner, links,
    // size, mtime, device numbers, link target.
    let listing = "cd /dev && find . -xdev ! -path ./pts ! -path ./shm ! -path ./mqueue -exec stat -c '%n|%F|%a|%u:%g|%h|%s|%Y|%t:%T|%N' {} + | sort; cat /dev/sub/hl";
    let at_sp = sb.sh(listing).stdout;
    assert!(
        at_sp.contains("./sub/hl|regular file|640|0:0|2|5|") && at_sp.contains("./null|character special file|666"),
        "{at_sp}"
    );
    // The mounts on /dev and the masked directories, with their options (Podman's own: /dev is
    // noexec on Podman 4.3, not on 5.4), in any order (CRIU 4.1 mounts /proc/acpi first).
    let mountinfo = "awk '{for (i = 7; i <= NF && $i != \"-\"; i++); print $5, $6, $(i + 1)}' /proc/self/mountinfo";
    let dev_mounts = |sb: &Sandbox| {
        let all = sb.sh(mountinfo).stdout;
        // (sorted, each kept: a mount restored twice is not the statepoint's)
        let mut mounts: Vec<String> = all
            .lines()
            .filter(|l| ["/dev ", "/dev/", "/proc/acpi ", "/sys/firmware "].iter().any(|p| l.starts_with(p)))
            .map(String::from)
            .collect();
        mounts.sort();
        mounts
    };
    let mounts_at_sp = dev_mounts(&sb);
    for want in ["/dev rw,nosuid", "/dev/pts ", "/dev/mqueue ", "/dev/shm ", "/proc/acpi ro,", "/sys/firmware ro,"] {
        assert!(mounts_at_sp.iter().any(|l| l.starts_with(want)), "{want:?} missing from {mounts_at_sp:?}");
    }
    let sp = sb.snapshot("dev-v1");
    // CRIU archived no tmpfs: planarian keeps /dev, and the masked directories are external.
    let id = sb.id();
    let spdir = Path::new("/var/lib/planarian/containers").join(&id).join("statepoints").join(&sp);
    let tars: Vec<String> = std::fs::read_dir(spdir.join("criu"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("tmpfs-"))
        .collect();
    assert!(tars.is_empty(), "CRIU archived tmpfs mounts: {tars:?}");
    assert!(spdir.join("dev.json").is_file(), "no /dev archive in {}", spdir.display());

    sb.exec("rm -rf /dev/agent-note /dev/sub /dev/ff && echo later > /dev/later").ok();
    assert_ne!(sb.sh(listing).stdout, at_sp);
    sb.rollback(&sp);
    assert_eq!(sb.sh(listing).stdout, at_sp, "/dev is exactly the statepoint's");
    assert_eq!(sb.sh("test -e /dev/later; echo $?").out(), "1");
    // The devices work, and the mounts on /dev and the masked directories are back, exactly.
    assert_eq!(sb.sh("head -c 4096 /dev/urandom | wc -c; echo x > /dev/null && echo null-ok").out(), "4096\nnull-ok");
    assert_eq!(dev_mounts(&sb), mounts_at_sp, "the mounts after the rollback");
    // Masked directories stay empty and read-only.
    for d in ["/proc/acpi", "/sys/firmware"] {
        assert_eq!(sb.sh(&format!("ls -A {d} | wc -l; touch {d}/x 2>/dev/null; echo $?")).out(), "0\n1", "{d}");
    }
    // And the next snapshot of the restored sandbox keeps /dev the same way.
    let sp2 = sb.snapshot("dev-v2");
    assert!(Path::new("/var/lib/planarian/containers")
        .join(&id)
        .join("statepoints")
        .join(&sp2)
        .join("dev.json")
        .is_file());
}

#[test]
fn chains_roll_back_in_any_order() {
    require_stack!();
    let mut sb = Sandbox::start("chain", 16, &[]);
    let mut expected = Vec::new();
    for i in 1..=3 {
        sb.send("tick");
        let st = sb.send(&format!("dirty {} 8192", i * 100_000));
        sb.sh(&format!("echo {i} > /root/version; touch /root/only-in-{i}")).ok();
        let sp = sb.snapshot(&format!("step-{i}"));
        expected.push((sp, st, format!("{i}\n")));
    }
    sb.send("dirty 0 100000");
    sb.sh("echo 4 > /root/version").ok();
    let ids: Vec<String> = sb.statepoints().iter().map(|m| m["statepoint-id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, expected.iter().map(|e| e.0.clone()).collect::<Vec<_>>());
    for k in [0usize, 2, 1] {
        let (sp, st, version) = &expected[k];
        sb.rollback(sp);
        let now = sb.send("tick");
        assert_eq!(now.counter, st.counter + 1, "counter after rollback to {sp}");
        assert_eq!(now.checksum, st.checksum, "memory after rollback to {sp}");
        assert_eq!(&sb.sh("cat /root/version").stdout, version, "files after rollback to {sp}");
        let only = sb.sh("ls /root | grep only-in | tr '\\n' ' '").out();
        let want: Vec<String> = (1..=k + 1).map(|i| format!("only-in-{i}")).collect();
        assert_eq!(only, want.join(" "), "files after rollback to {sp}");
    }
    // Every statepoint is still there.
    assert_eq!(sb.statepoints().len(), 3);
}

#[test]
fn podman_checkpoint_creates_new_statepoints_and_restore_brings_it_back() {
    require_stack!();
    let mut sb = Sandbox::start("podman", 8, &[]);
    sb.send("tick");
    // Podman's own command, with a repeated flag as Podman itself sends it; --print-stats too.
    let r = podman("planarian", &["container", "checkpoint", "--leave-running", "--print-stats", &sb.name]);
    r.ok();
    let stats: serde_json::Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout));
    let dump = &stats["container_statistics"][0]["criu_statistics"];
    assert!(dump["pages_written"].as_u64().unwrap_or(0) > 0, "{stats}");
    assert_eq!(sb.statepoints().len(), 1);
    let at_sp2 = sb.send("tick");
    // Without --leave-running Podman stops the container after the statepoint.
    podman("planarian", &["container", "checkpoint", &sb.name]).ok();
    assert_eq!(sb.statepoints().len(), 2, "each checkpoint is a new statepoint");
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(), "exited");
    // --print-stats reads CRIU's restore statistics where Podman expects them.
    let r = podman("planarian", &["container", "restore", "--print-stats", &sb.name]);
    r.ok();
    let stats: serde_json::Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout));
    assert!(stats["container_statistics"][0]["criu_statistics"]["restore_time"].as_u64().unwrap_or(0) > 0, "{stats}");
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(), "running");
    sb.seq = sb.read().unwrap().0;
    let after = sb.send("tick");
    assert_eq!((after.counter, &after.checksum), (at_sp2.counter + 1, &at_sp2.checksum));
    // The restored init is conmon's child and Podman's tooling works.
    let logs = podman("planarian", &["logs", &sb.name]);
    logs.ok();
    podman("planarian", &["kill", "-s", "KILL", &sb.name]).ok();
    assert!(wait_for(Duration::from_secs(120), || {
        podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out() == "exited"
    }));
    podman("planarian", &["rm", &sb.name]).ok();
}

/// What Podman prints for `checkpoint NAME`, `restore NAME`, `checkpoint -a` and `restore -a`
/// under one runtime, with the containers' IDs and names replaced by A and B: two containers
/// running `sleep`, checkpointed and restored one by one, then all at once.
fn podman_checkpoint_output(rt: &str) -> Vec<(String, String, String)> {
    let (a, b) = (name(&format!("{rt}-out-a")), name(&format!("{rt}-out-b")));
    let (_ca, _cb) = (Cleanup(a.clone()), Cleanup(b.clone()));
    let ids: Vec<String> = [&a, &b]
        .iter()
        // (without the bridge: its teardown and setup at each checkpoint and restore cost seconds
        // under emulation; the demo and the TCP test checkpoint and restore on it)
        .map(|n| podman(rt, &["run", "-d", "--name", n, "--network", "none", BUSYBOX, "sleep", "100000"]).ok().out())
        .collect();
    let anonymise = |s: &str| s.replace(&ids[0], "ID-A").replace(&ids[1], "ID-B").replace(&a, "A").replace(&b, "B");
    let mut seen = vec![];
    for args in [
        vec!["container", "checkpoint", a.as_str()],
        vec!["container", "restore", a.as_str()],
        vec!["container", "checkpoint", "--leave-running", a.as_str()],
        vec!["container", "checkpoint", "-a"],
        vec!["container", "restore", "-a"],
    ] {
        let r = podman(rt, &args);
        assert_eq!(r.code, Some(0), "{rt}: podman {args:?}: {r:?}");
        // `-a` names the containers in no particular order.
        let mut lines: Vec<String> = anonymise(&r.stdout).lines().map(String::from).collect();
        lines.sort();
        seen.push((args.join(" ").replace(&a, "A"), lines.join("\n"), anonymise(&r.stderr)));
    }
    for n in [&a, &b] {
        assert_eq!(
            podman(rt, &["inspect", "--format", "{{.State.Status}}", n]).out(),
            "running",
            "{rt}: {n} after restore -a"
        );
    }
    seen
}

#[test]
fn podman_checkpoint_and_restore_print_exactly_what_a_plain_runtime_prints() {
    require_stack!();
    let ours = podman_checkpoint_output("planarian");
    // Exactly the names or IDs and nothing on stderr: what scripts and Podman's own tests read.
    let expected: Vec<(String, String, String)> = [
        ("container checkpoint A", "A"),
        ("container restore A", "A"),
        ("container checkpoint --leave-running A", "A"),
        ("container checkpoint -a", "ID-A\nID-B"),
        ("container restore -a", "ID-A\nID-B"),
    ]
    .iter()
    .map(|(c, o)| (c.to_string(), o.to_string(), String::new()))
    .collect();
    assert_eq!(ours, expected);
    // Byte for byte what a plain runtime gives: crun where it is built with CRIU (Debian 13's, with
    // libcriu2), runc where it is not (Debian 12's).
    let crun = cmd("crun", ["--version"]).stdout;
    assert_eq!(ours, podman_checkpoint_output(if crun.contains("+CRIU") { "crun" } else { "runc" }));
}

#[test]
fn listening_tcp_socket_survives_rollback() {
    require_stack!();
    let n = name("tcp");
    let _c = Cleanup(n.clone());
    podman("planarian", &["run", "-d", "--name", &n, DEBIAN, "python3", "-c",
        "import socket,time; s=socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); open('/tmp/up','w').close(); time.sleep(100000)"]).ok();
    // (read in its namespaces, not by `podman exec`: seconds each under emulation)
    let ctr = Ctr::new(&n);
    assert!(wait_for(Duration::from_secs(60), || ctr.read("tmp/up").is_some()));
    let listening = || ctr.sh("grep -c ':1F90 00000000:0000 0A' /proc/net/tcp").out();
    assert_eq!(listening(), "1");
    podman("planarian", &["container", "checkpoint", "--leave-running", "--tcp-established", &n]).ok();
    let sp = cmd(planarian_bin().to_str().unwrap(), ["statepoint", "list", &n, "--json"]);
    let sps: serde_json::Value = serde_json::from_str(&sp.stdout).unwrap();
    assert_eq!(sps[0]["options"]["tcp-established"], true);
    cmd(planarian_bin().to_str().unwrap(), ["rollback", &n, "sp1"]).ok();
    assert_eq!(listening(), "1", "the listening socket is back after rollback");
}

#[test]
fn bad_input_is_a_clear_error_and_changes_nothing() {
    require_stack!();
    let mut sb = Sandbox::start("bad", 4, &[]);
    let before = sb.send("tick");
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    let r = cmd(pl, ["rollback", &sb.name, "sp42"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.trim(), "planarian: unknown statepoint sp42 (see `planarian statepoint list`)");
    assert_eq!(sb.send("tick").counter, before.counter + 1, "the sandbox kept running");

    let r = cmd(pl, ["rollback", "pltest-no-such-container", "sp1"]);
    assert_eq!((r.code, r.stderr.trim()), (Some(1), "planarian: no such container pltest-no-such-container"));

    let other = name("crun");
    let _o = Cleanup(other.clone());
    podman("crun", &["run", "-d", "--name", &other, "--network", "none", BUSYBOX, "sleep", "600"]).ok();
    let r = cmd(pl, ["rollback", &other, "sp1"]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("is not run by planarian (its runtime is crun)"), "{r:?}");

    let stopped = name("stopped");
    let _s = Cleanup(stopped.clone());
    podman("planarian", &["create", "--name", &stopped, BUSYBOX, "sleep", "600"]).ok();
    let r = cmd(pl, ["snapshot", &stopped]);
    assert_eq!(r.code, Some(1));
    assert_eq!(r.stderr.trim(), format!("planarian: container {stopped} is not running (it is created)"));
    assert!(sb.statepoints().is_empty());
}

/// Replaces criu by a wrapper for one test: a real criu that gets killed mid-dump, or one that
/// hangs so that planarian itself can be killed mid-checkpoint. Restores the config on drop.
struct CriuWrapper {
    dropin: &'static Path,
    _scratch: tempfile::TempDir,
}

impl CriuWrapper {
    fn new(body: &str) -> CriuWrapper {
        let scratch = tempfile::tempdir().unwrap();
        let script = scratch.path().join("criu");
        std::fs::write(&script, format!("#!/bin/bash\n{body}\n")).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dropin = Path::new("/etc/planarian/planarian.conf.d/zz-test-criu.conf");
        std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
        std::fs::write(dropin, format!("[runtime]\ncriu_path = \"{}\"\n", script.display())).unwrap();
        CriuWrapper { dropin, _scratch: scratch }
    }
}

impl Drop for CriuWrapper {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dropin);
    }
}

#[test]
fn criu_killed_mid_dump_leaves_no_statepoint_and_the_sandbox_running() {
    require_stack!();
    let mut sb = Sandbox::start("kill", 32, &[]);
    let sp = sb.snapshot("good");
    let before = sb.send("tick");
    {
        // Killed at a point every dump reaches, however fast: CRIU's post-dump action (images
        // written, tasks still frozen, success not yet reported) holds it until it is killed.
        let _w = CriuWrapper::new(concat!(
            "[ \"$1\" = dump ] || exec /usr/sbin/criu \"$@\"\n",
            "m=/tmp/pltest-at-post-dump.$$ s=/tmp/pltest-action.$$\n",
            "printf '#!/bin/sh\\n[ \"$CRTOOLS_SCRIPT_ACTION\" = post-dump ] || exit 0\\ntouch %s\\nwhile [ -e %s ]; do sleep 0.05; done\\n' $m $m > $s\n",
            "chmod +x $s\n",
            "/usr/sbin/criu \"$@\" --action-script $s & c=$!\n",
            "while [ ! -e $m ] && kill -0 $c 2>/dev/null; do sleep 0.05; done\n",
            "kill -9 $c; wait $c; rc=$?; rm -f $m $s; exit $rc"
        ));
        let r = cmd(planarian_bin().to_str().unwrap(), ["snapshot", &sb.name]);
        assert_ne!(r.code, Some(0), "{r:?}");
        assert!(r.stderr.contains("criu dump failed"), "{r:?}");
    }
    let ids: Vec<String> = sb.statepoints().iter().map(|m| m["statepoint-id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, vec![sp.clone()], "no statepoint was committed");
    let after = sb.send("tick");
    assert_eq!((after.counter, &after.checksum), (before.counter + 1, &before.checksum), "running, as it was");
    sb.rollback(&sp);
}

#[test]
fn planarian_killed_mid_checkpoint_is_recovered_by_the_next_one() {
    require_stack!();
    let mut sb = Sandbox::start("crash", 8, &[]);
    let before = sb.send("tick");
    // Killed once: `planarian fsck` sees what it left, and `--repair` puts it right.
    kill_planarian_mid_snapshot(&sb);
    let found = fsck(&sb.name, false);
    assert_eq!(found.0, Some(1), "{found:?}");
    assert_eq!(found.1, vec!["pending", "frozen"], "{found:?}");
    let repaired = fsck(&sb.name, true);
    assert_eq!((repaired.0, repaired.1.len()), (Some(0), 0), "{repaired:?}");
    assert_eq!(status(&sb.name), "running");
    assert!(sb.statepoints().is_empty(), "nothing was committed");
    let mid = sb.send("tick");
    assert_eq!((mid.counter, &mid.checksum), (before.counter + 1, &before.checksum));
    let before = mid;
    // Killed again: the next statepoint operation recovers by itself.
    kill_planarian_mid_snapshot(&sb);
    assert_eq!(fsck(&sb.name, false).1, vec!["pending", "frozen"]);
    // The next statepoint operation thaws the sandbox and drops the half-made statepoint.
    let sp = sb.snapshot("after-crash");
    assert_eq!(sb.statepoints().len(), 1, "only the new statepoint is committed");
    let after = sb.send("tick");
    assert_eq!((after.counter, &after.checksum), (before.counter + 1, &before.checksum));
    sb.rollback(&sp);
    assert_eq!(fsck(&sb.name, false), (Some(0), vec![]));

    // A committed statepoint that lost a part is reported, by the statepoint built on it too,
    // and never repaired away.
    let sp2 = sb.snapshot("on-it");
    let id = sb.id();
    let images =
        |sp: &str| Path::new("/var/lib/planarian/containers").join(&id).join("statepoints").join(sp).join("criu");
    // sp's own images, and those sp2 builds on (sp's, or the base its rollback made of them).
    let mut lose = vec![images(&sp).join("inventory.img")];
    let under = std::fs::canonicalize(images(&sp2).join("parent")).unwrap().join("inventory.img");
    if std::fs::canonicalize(&under).unwrap() != std::fs::canonicalize(&lose[0]).unwrap() {
        lose.push(under);
    }
    for f in &lose {
        std::fs::rename(f, f.with_extension("aside")).unwrap();
    }
    let lost = planarian(&["fsck", &sb.name, "--repair"]);
    assert_eq!(lost.code, Some(1), "{lost:?}");
    assert!(lost.stdout.contains(&format!("problem    {sp}: images:")), "{lost:?}");
    assert!(lost.stdout.contains(&format!("problem    {sp2}: chain:")), "{lost:?}");
    for f in &lose {
        std::fs::rename(f.with_extension("aside"), f).unwrap();
    }
    assert_eq!(fsck(&sb.name, false), (Some(0), vec![]));
    assert_eq!(sb.statepoints().len(), 2);
}

/// Starts a snapshot whose CRIU hangs, and kills planarian (and everything it started) once the
/// sandbox is frozen and CRIU started.
fn kill_planarian_mid_snapshot(sb: &Sandbox) {
    let child = {
        let _w = CriuWrapper::new("sleep 600");
        let child = std::process::Command::new(planarian_bin())
            .args(["snapshot", &sb.name])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until the checkpoint in progress has frozen the container and started "CRIU",
        // then kill planarian (and everything it started) the hard way.
        // (pgrep and pkill never match themselves; a shell around them would.)
        assert!(wait_for(Duration::from_secs(60), || cmd("pgrep", ["-f", "^sleep 600"]).code == Some(0)));
        let _ = cmd("pkill", ["-9", "-f", "planarian snapshot"]);
        let _ = cmd("pkill", ["-9", "-f", "^sleep 600"]);
        child
    };
    let mut child = child;
    let _ = child.wait();
}

/// `planarian fsck CTR [--repair] --json`: its exit code and the checks of what is wrong now.
fn fsck(name: &str, repair: bool) -> (Option<i32>, Vec<String>) {
    let mut args = vec!["fsck", name, "--json"];
    if repair {
        args.push("--repair");
    }
    let r = planarian(&args);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {r:?}"));
    let checks = v["containers"][0]["findings"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|f| f["check"].as_str().unwrap().to_string())
        .collect();
    (r.code, checks)
}

fn status(name: &str) -> String {
    podman("planarian", &["inspect", "--format", "{{.State.Status}}", name]).out()
}

#[test]
fn disk_full_while_copying_files_leaves_no_statepoint() {
    require_stack!();
    // A store too small for the container's files.
    let store = Path::new("/var/lib/planarian-small");
    std::fs::create_dir_all(store).unwrap();
    cmd("mount", ["-t", "tmpfs", "-o", "size=3m", "tmpfs", store.to_str().unwrap()]).ok();
    let dropin = Path::new("/etc/planarian/planarian.conf.d/zz-test-small-store.conf");
    // (Run alone, in a fresh guest, the drop-in directory does not exist yet.)
    std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
    std::fs::write(dropin, format!("[store]\npath = \"{}\"\n", store.display())).unwrap();
    struct Undo<'a>(&'a Path, &'a Path);
    impl Drop for Undo<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(self.0);
            let _ = std::process::Command::new("umount").arg(self.1).status();
        }
    }
    let _undo = Undo(dropin, store);
    let n = name("full");
    let _c = Cleanup(n.clone());
    podman(
        "planarian",
        &[
            "run",
            "--network",
            "none",
            "-d",
            "--name",
            &n,
            BUSYBOX,
            "sh",
            "-c",
            "dd if=/dev/urandom of=/big bs=1M count=4 2>/dev/null; touch /ready; sleep 100000",
        ],
    )
    .ok();
    assert!(wait_for(Duration::from_secs(60), || Ctr::new(&n).read("ready").is_some()));
    let r = cmd(planarian_bin().to_str().unwrap(), ["snapshot", &n]);
    assert_eq!(r.code, Some(1), "{r:?}");
    // The files' copy and CRIU's images fill the store side by side: whichever finds it full
    // first fails the snapshot (CRIU, when its own log could not be written, says only that it
    // failed). Either way, what follows must hold.
    assert!(r.stderr.contains("No space left on device") || r.stderr.contains("criu dump failed"), "{r:?}");
    let list = cmd(planarian_bin().to_str().unwrap(), ["statepoint", "list", &n, "--json"]);
    assert_eq!(list.out(), "[]");
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &n]).out(), "running");
    assert!(podman("planarian", &["exec", &n, "echo", "alive"]).stdout.contains("alive"), "the sandbox is not frozen");
}

#[test]
fn concurrent_checkpoints_serialise() {
    require_stack!();
    let sb = Sandbox::start("conc", 8, &[]);
    let pl = planarian_bin();
    let spawn = || std::process::Command::new(&pl).args(["snapshot", &sb.name]).output().unwrap();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.status.success() && b.status.success(), "{a:?} {b:?}");
    let mut ids = vec![
        String::from_utf8_lossy(&a.stdout).trim().to_string(),
        String::from_utf8_lossy(&b.stdout).trim().to_string(),
    ];
    ids.sort();
    assert_eq!(ids, vec!["sp1", "sp2"]);
    assert_eq!(sb.statepoints().len(), 2);
}

/// A remote-state hook for the test: a "service" whose state is a position in a file; it logs
/// every call. (The MCP state-proxy sidecar implements the same contract for real databases.)
struct Hook {
    dropin: &'static Path,
    dir: std::path::PathBuf,
    _scratch: tempfile::TempDir,
}

impl Hook {
    fn new(fail_capture: bool) -> Hook {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().to_path_buf();
        std::fs::write(dir.join("position"), "0").unwrap();
        let d = dir.display();
        let capture = if fail_capture {
            "echo 'service unreachable' >&2; exit 1".to_string()
        } else {
            format!("echo \"{{\\\"external-endpoint\\\": \\\"test-service\\\", \\\"mcp-call-position\\\": $(cat {d}/position)}}\"")
        };
        let script = format!(
            "#!/bin/sh\necho \"$@\" >> {d}/calls\ncase $1 in\n capture) {capture};;\n compensate) echo $3 > {d}/position;;\nesac\n"
        );
        let hook = dir.join("hook");
        std::fs::write(&hook, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(0o755)).unwrap();
        let dropin = Path::new("/etc/planarian/planarian.conf.d/zz-test-hook.conf");
        std::fs::create_dir_all(dropin.parent().unwrap()).unwrap();
        std::fs::write(dropin, format!("[hooks]\nremote = [\"{}\"]\n", hook.display())).unwrap();
        Hook { dropin, dir, _scratch: scratch }
    }

    fn set_position(&self, p: u64) {
        std::fs::write(self.dir.join("position"), p.to_string()).unwrap();
    }

    fn position(&self) -> String {
        std::fs::read_to_string(self.dir.join("position")).unwrap().trim().to_string()
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').next().unwrap().to_string())
            .collect()
    }
}

impl Drop for Hook {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dropin);
    }
}

#[test]
fn remote_hooks_record_positions_and_compensate_before_the_restore() {
    require_stack!();
    let hook = Hook::new(false);
    let mut sb = Sandbox::start("hook", 8, &[]);
    hook.set_position(5);
    let at_sp = sb.send("tick");
    let sp = sb.snapshot("remote-5");
    let m = &sb.statepoints()[0];
    assert_eq!(m["remote-state"][0]["mcp-call-position"], 5);
    assert_eq!(m["remote-state"][0]["external-endpoint"], "test-service");
    hook.set_position(9);
    sb.send("tick");
    sb.rollback(&sp);
    assert_eq!(hook.position(), "5", "the remote state was compensated back to the statepoint");
    assert_eq!(sb.send("tick").counter, at_sp.counter + 1);
    // compensate came after the capture of where the service was.
    assert_eq!(hook.calls(), vec!["capture", "capture", "compensate"]);
}

#[test]
fn a_failing_remote_hook_leaves_no_statepoint() {
    require_stack!();
    let mut sb = Sandbox::start("hookfail", 8, &[]);
    let before = sb.send("tick");
    let _hook = Hook::new(true);
    let r = cmd(planarian_bin().to_str().unwrap(), ["snapshot", &sb.name]);
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("capture failed: service unreachable"), "{r:?}");
    assert!(sb.statepoints().is_empty());
    assert_eq!(sb.send("tick").counter, before.counter + 1, "the sandbox runs on");
}

#[test]
fn exec_waits_for_a_snapshot_in_progress() {
    require_stack!();
    let sb = Sandbox::start("execlock", 8, &[]);
    sb.snapshot("first");
    let _w = CriuWrapper::new("[ \"$1\" = dump ] && sleep 5\nexec /usr/sbin/criu \"$@\"");
    let pl = planarian_bin();
    let start = std::time::Instant::now();
    let (snap_end, exec_end, exec_ok) = std::thread::scope(|s| {
        let snap = s.spawn(|| {
            let ok = std::process::Command::new(&pl)
                .args(["snapshot", &sb.name])
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap()
                .success();
            (ok, start.elapsed())
        });
        // Once the container is frozen, a tool call must wait for the snapshot to finish.
        assert!(wait_for(Duration::from_secs(120), || cmd(
            "sh",
            ["-c", "ls /var/lib/planarian/containers/*/frozen-by-planarian"]
        )
        .code
            == Some(0)));
        let r = podman("planarian", &["exec", &sb.name, "echo", "tool-call"]);
        let exec_end = start.elapsed();
        let (ok, snap_end) = snap.join().unwrap();
        assert!(ok, "the snapshot failed");
        (snap_end, exec_end, r.stdout.contains("tool-call"))
    });
    assert!(exec_ok);
    assert!(
        exec_end + Duration::from_millis(500) >= snap_end,
        "exec finished at {exec_end:?}, before the snapshot ended at {snap_end:?}"
    );
    assert_eq!(sb.statepoints().len(), 2);
}

#[test]
fn registry_cli_names_removes_and_retains() {
    require_stack!();
    let mut sb = Sandbox::start("registry", 4, &[]);
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    let sp1 = cmd(pl, ["snapshot", &sb.name]).out();
    cmd(
        pl,
        [
            "statepoint",
            "set",
            &sb.name,
            &sp1,
            "--name",
            "base",
            "--description",
            "clean checkout",
            "--outcome",
            "tests failed",
        ],
    )
    .ok();
    let m: serde_json::Value = serde_json::from_str(&cmd(pl, ["statepoint", "show", &sb.name, "base"]).stdout).unwrap();
    assert_eq!(m["statepoint-id"], sp1.as_str());
    assert_eq!(m["state-evidence"]["state-description"], "clean checkout");
    assert_eq!(m["state-evidence"]["prior-outcomes"][0]["text"], "tests failed");
    assert_eq!(m["state-evidence"]["prior-outcomes"][0]["status"], "info");
    assert_eq!(m["status"], "committed");
    let table = cmd(pl, ["statepoint", "list", &sb.name]).stdout;
    assert!(table.lines().nth(1).is_some_and(|l| l.contains("base") && l.contains("clean checkout")), "{table}");

    // A bad id among good ones changes nothing.
    let sp2 = cmd(pl, ["snapshot", &sb.name]).out();
    let r = cmd(pl, ["statepoint", "rm", &sb.name, &sp2, "sp99"]);
    assert_eq!(r.code, Some(1));
    assert_eq!(sb.statepoints().len(), 2);
    cmd(pl, ["statepoint", "rm", &sb.name, &sp2]).ok();
    assert_eq!(sb.statepoints().len(), 1);

    // Retention: only the newest N are kept.
    let dropin = Path::new("/etc/planarian/planarian.conf.d/zz-test-retention.conf");
    std::fs::write(dropin, "[store]\nretention = 2\n").unwrap();
    let ids: Vec<String> = (0..3).map(|_| cmd(pl, ["snapshot", &sb.name]).out()).collect();
    let _ = std::fs::remove_file(dropin);
    let kept: Vec<String> = sb.statepoints().iter().map(|m| m["statepoint-id"].as_str().unwrap().to_string()).collect();
    assert_eq!(kept, ids[1..].to_vec());
    // The kept ones restore.
    let before = sb.send("tick");
    sb.rollback(&ids[1]);
    assert_eq!(sb.send("tick").checksum, before.checksum);
}

#[test]
fn terminal_container_snapshots_rolls_back_and_keeps_its_console() {
    require_stack!();
    let mut sb = Sandbox::start("tty", 16, &["-t"]);
    assert!(sb.sh("readlink /proc/1/fd/0").stdout.starts_with("/dev/pts/"), "the workload runs on a terminal");
    sb.send("tick");
    let at_sp = sb.send("tick");
    let sp = sb.snapshot("on-a-terminal");
    sb.send("dirty 0 65536");
    sb.rollback(&sp);
    let now = sb.send("tick");
    assert_eq!((now.counter, &now.checksum), (at_sp.counter + 1, &at_sp.checksum));
    // The restored process has a terminal again, and conmon reads it: output reaches podman logs.
    assert!(sb.sh("readlink /proc/1/fd/1").stdout.starts_with("/dev/pts/"));
    sb.sh("echo console-after-rollback > /proc/1/fd/1").ok();
    assert!(
        wait_for(std::time::Duration::from_secs(120), || podman("planarian", &["logs", &sb.name])
            .stdout
            .contains("console-after-rollback")),
        "podman logs: {}",
        podman("planarian", &["logs", &sb.name]).stdout
    );
    // Podman's own checkpoint and restore of a terminal container.
    podman("planarian", &["container", "checkpoint", &sb.name]).ok();
    podman("planarian", &["container", "restore", &sb.name]).ok();
    assert_eq!(sb.send("tick").checksum, at_sp.checksum);
    sb.sh("echo console-after-restore > /proc/1/fd/1").ok();
    assert!(wait_for(std::time::Duration::from_secs(120), || podman("planarian", &["logs", &sb.name])
        .stdout
        .contains("console-after-restore")));
    // The dump after the restore stayed incremental (the pre-resume step ran in-process): on
    // the checkpoint Podman took (depth 1, on the base the rollback left), so at depth 2; and
    // that chain, built on Podman's checkpoint, restores exactly.
    let at_sp2 = sb.send("dirty 4194304 65536");
    let sp2 = sb.snapshot("after-restore");
    sb.assert_incremental(&sp2, 2, 2_048);
    sb.send("dirty 0 1000000");
    sb.rollback(&sp2);
    assert_eq!(sb.send("tick").checksum, at_sp2.checksum, "memory after rollback to {sp2}");
}

/// The context library end to end: a statepoint records a description and structured state, an
/// agent appends what happened after another, and a rollback tells exactly what is now true and
/// what was tried from there (and records that it left the other branch).
#[test]
fn a_rollback_tells_the_agent_what_is_now_true_and_what_was_tried() {
    require_stack!();
    let mut sb = Sandbox::start("context", 4, &[]);
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    sb.sh("echo v1 > /tmp/app.conf").ok();
    let at_sp1 = sb.send("tick");
    let scratch = tempfile::tempdir().unwrap();
    let state_file = scratch.path().join("state.json");
    std::fs::write(&state_file, r#"{"task": "fix the build", "step": 3}"#).unwrap();
    let sp1 = cmd(
        pl,
        [
            "snapshot",
            &sb.name,
            "--name",
            "configured",
            "--description",
            "app configured, tests not run yet",
            "--state",
            state_file.to_str().unwrap(),
        ],
    )
    .out();

    let dirtied = sb.send("dirty 0 65536");
    assert_ne!(dirtied.checksum, at_sp1.checksum);
    sb.sh("echo broken > /tmp/app.conf").ok();
    let sp2 = cmd(pl, ["snapshot", &sb.name, "--description", "config rewritten"]).out();
    cmd(
        pl,
        [
            "statepoint",
            "set",
            &sb.name,
            &sp2,
            "--outcome",
            "tests fail: config broken",
            "--status",
            "failure",
            "--by",
            "agent",
            "--reward",
            "-1",
        ],
    )
    .ok();

    let r = cmd(
        pl,
        ["rollback", &sb.name, "configured", "--reason", "the new config broke the tests", "--by", "agent", "--json"],
    );
    r.ok();
    let ctx: serde_json::Value =
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", r.stdout));
    assert_eq!(ctx["operation"], "rollback");
    assert_eq!(ctx["statepoint"]["id"], sp1.as_str());
    assert_eq!(ctx["statepoint"]["name"], "configured");
    assert_eq!(ctx["statepoint"]["description"], "app configured, tests not run yet");
    assert_eq!(ctx["statepoint"]["state"]["task"], "fix the build");
    assert_eq!(ctx["discarded-statepoints"], serde_json::json!([sp2]));
    assert_eq!(ctx["reason"], "the new config broke the tests");
    // What it says is true: the files and the memory of sp1.
    assert_eq!(sb.sh("cat /tmp/app.conf").out(), "v1");
    sb.seq = sb.read().expect("state after rollback").0;
    let after = sb.send("tick");
    assert_eq!((after.counter, after.checksum.as_str()), (at_sp1.counter + 1, at_sp1.checksum.as_str()));

    // The ledger: a tree whose head is sp1 again, with what was tried after each statepoint.
    let text = cmd(pl, ["ledger", &sb.name]).out();
    assert!(text.contains(&format!("{sp1}* \"configured\"")), "{text}");
    assert!(text.contains(&format!("→ abandoned (agent): rolled back here from the state after {sp2}; left {sp2}; reason: the new config broke the tests")), "{text}");
    assert!(text.contains("→ failure (agent, reward -1): tests fail: config broken"), "{text}");
    let sp3 = cmd(pl, ["snapshot", &sb.name, "--description", "second try"]).out();
    let ledger: serde_json::Value = serde_json::from_str(&cmd(pl, ["ledger", &sb.name, "--json"]).out()).unwrap();
    let node = |id: &str| ledger["statepoints"].as_array().unwrap().iter().find(|n| n["id"] == id).cloned().unwrap();
    assert_eq!(node(&sp1)["children"], serde_json::json!([sp2, sp3]), "{ledger}");
    assert_eq!(node(&sp3)["parent"], sp1.as_str());
    assert_eq!(ledger["head"], sp3.as_str());
    // Kept: the restore context can be fetched again, as the text a model reads.
    let again = cmd(pl, ["statepoint", "context", &sb.name]).out();
    assert!(
        again.starts_with(&format!(
            "[planarian] The sandbox {} was rolled back to statepoint {sp1} \"configured\".",
            sb.name
        )),
        "{again}"
    );
    assert!(again.contains("Tried from this statepoint before:") || again.contains("Nothing was tried"), "{again}");
    eprintln!(
        "--- planarian ledger:\n{}\n--- planarian statepoint context:\n{again}\n---",
        cmd(pl, ["ledger", &sb.name]).out()
    );
    // A bounded ledger keeps the head and says what it left out.
    let short = cmd(pl, ["ledger", &sb.name, "--max-chars", "200"]).out();
    assert!(short.contains(&format!("{sp3}*")) && short.contains("left out"), "{short}");
}

/// `snapshot --async` (paper §5.3): the caller gets the id at once, a tool call issued right after
/// waits for the snapshot (so its effect is not in it), two in a row commit in order, and the
/// caller's latency is measured beside the synchronous snapshot's.
#[test]
fn an_async_snapshot_answers_at_once_and_the_next_tool_call_waits_for_it() {
    require_stack!();
    let mut sb = Sandbox::start("async", 32, &[]);
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    sb.sh("echo before > /tmp/mark").ok();
    let at_sp1 = sb.send("tick");
    let t = std::time::Instant::now();
    let sp1 = cmd(pl, ["snapshot", &sb.name, "--async", "--name", "a1"]).out();
    let answered = t.elapsed();
    // Issued while the worker snapshots: it waits on the container's lock, then runs.
    sb.exec("echo after > /tmp/mark").ok();
    assert_eq!(cmd(pl, ["statepoint", "wait", &sb.name, &sp1]).out(), format!("{sp1} committed"));
    let async_total = sb.manifest(&sp1)["measurements"]["total-ms"].as_f64().unwrap();

    // Two in a row: the second call waits for the first worker; they commit in order.
    let sp2 = cmd(pl, ["snapshot", &sb.name, "--async"]).out();
    let sp3 = cmd(pl, ["snapshot", &sb.name, "--async"]).out();
    for sp in [&sp2, &sp3] {
        assert_eq!(cmd(pl, ["statepoint", "wait", &sb.name, sp]).out(), format!("{sp} committed"));
    }
    assert_eq!(sb.manifest(&sp3)["parent-statepoint-id"], sp2.as_str());
    assert_eq!(sb.manifest(&sp2)["parent-statepoint-id"], sp1.as_str());
    // Waited for by the name it was asked for, while still pending.
    let sp4 = cmd(pl, ["snapshot", &sb.name, "--async", "--name", "by-name"]).out();
    assert_eq!(cmd(pl, ["statepoint", "wait", &sb.name, "by-name"]).out(), format!("{sp4} committed"));

    let t = std::time::Instant::now();
    cmd(pl, ["snapshot", &sb.name]).ok();
    let sync = t.elapsed();
    eprintln!("snapshot latency as the caller sees it (32 MiB sandbox): --async answered in {answered:?} (the snapshot itself took {async_total:.0} ms), synchronous {sync:?}");

    // The statepoint has the state from before the tool call issued after it.
    sb.rollback(&sp1);
    assert_eq!(sb.sh("cat /tmp/mark").out(), "before");
    let after = sb.send("tick");
    assert_eq!((after.counter, after.checksum.as_str()), (at_sp1.counter + 1, at_sp1.checksum.as_str()));
}

/// What a tool call leaves running is in the statepoint: a background process started through
/// `podman exec` (without a terminal crun keeps it in conmon's session, outside the container,
/// which CRIU refuses to dump), and after it is killed its zombie. A rollback brings it back,
/// same PID; an exec of a missing command still fails in crun's words and with its code.
#[test]
fn a_background_process_started_by_exec_is_in_the_statepoint() {
    require_stack!();
    let n = name("bgexec");
    let _c = Cleanup(n.clone());
    podman("planarian", &["run", "-d", "--name", &n, "--network", "none", BUSYBOX, "sleep", "100000"]).ok();
    podman(
        "planarian",
        &["exec", &n, "sh", "-c", "(sh -c 'echo $$ > /tmp/bg.pid; exec sleep 100000' </dev/null >/dev/null 2>&1 &)"],
    )
    .ok();
    // "PID STATE" of the background process (S sleeping, Z a zombie); empty before it wrote its PID.
    // (read in its namespaces: the exec that started it is the point, not the reading)
    let ctr = Ctr::new(&n);
    let state = || {
        ctr.sh("p=$(cat /tmp/bg.pid) && echo $p $(awk '/^State:/ {print $2}' /proc/$p/status)")
            .stdout
            .trim()
            .to_string()
    };
    assert!(
        wait_for(Duration::from_secs(120), || state().ends_with(" S")),
        "the background process did not start: {}",
        state()
    );
    let before = state();
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    let sp1 = cmd(pl, ["snapshot", &n]).ok().out();
    // Killed, it stays a zombie (sleep as PID 1 reaps nothing): that too is dumped.
    ctr.sh("kill $(cat /tmp/bg.pid)").ok();
    assert!(wait_for(Duration::from_secs(120), || state().ends_with(" Z")), "not a zombie: {}", state());
    cmd(pl, ["snapshot", &n]).ok();
    cmd(pl, ["rollback", &n, &sp1]).ok();
    assert_eq!(state(), before, "the background process is back, same PID, sleeping");
    let missing = podman("planarian", &["exec", &n, "no-such-command"]);
    assert_eq!(missing.code, Some(127), "{missing:?}");
    assert!(missing.stderr.contains("executable file `no-such-command` not found in $PATH"), "{}", missing.stderr);
}

/// A snapshot asked for while a `podman exec` still writes waits for it to end, saying what it
/// waits for: the statepoint holds every line the command wrote and nothing after. A server
/// started with `podman exec -d` is not waited for at all; a tool call that runs on (its client
/// attached) is waited for at most `in_flight_wait_seconds`; the statepoint then says it does not
/// hold it (it runs outside the container's process tree).
#[test]
fn a_snapshot_waits_for_a_podman_exec_in_flight() {
    use std::io::BufRead;
    require_stack!();
    let _conf = DropIn::new("zz-inflight", "[checkpoint]\nin_flight_wait_seconds = 300\n");
    let mut sb = Sandbox::start("inflight", 8, &[]);
    let id = sb.id();
    let in_flight = Path::new("/var/lib/planarian/containers").join(&id).join("in-flight");
    // (a sandbox with statepoints: its store holds the lock tool calls take)
    sb.snapshot("first");
    // A tool call that writes until it is told to stop.
    let name = sb.name.clone();
    let writer = std::thread::spawn(move || {
        podman(
            "planarian",
            &["exec", &name, "sh", "-c", "while [ ! -e /stop ]; do echo x >> /w; sleep 0.2; done; echo done >> /w"],
        )
    });
    assert!(
        wait_for(Duration::from_secs(300), || std::fs::read_dir(&in_flight).is_ok_and(|mut d| d.next().is_some())),
        "the exec's holder names it in {}",
        in_flight.display()
    );
    let mut snap = std::process::Command::new(planarian_bin())
        .args(["snapshot", &sb.name])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = std::io::BufReader::new(snap.stderr.take().unwrap());
    let mut first = String::new();
    err.read_line(&mut first).unwrap();
    assert!(first.contains("waiting for what is in flight") && first.contains("while [ ! -e /stop ]"), "{first}");
    // The snapshot waits; the command ends (an exec meanwhile still runs: it only reads).
    sb.exec("touch /stop").ok();
    let out = snap.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    writer.join().unwrap().ok();
    let sp = String::from_utf8(out.stdout).unwrap().trim().to_string();
    sb.sh("echo later >> /w").ok();
    sb.rollback(&sp);
    let w = sb.sh("cat /w").stdout;
    assert!(w.ends_with("x\ndone\n"), "the statepoint holds all the exec wrote, and nothing after: {w}");
    // A server started with exec -d is the sandbox's own work, not a tool call: no one waits for
    // it (the bound is still 300 s), and the statepoint holds it running.
    podman("planarian", &["exec", "-d", &sb.name, "sleep", "600"]).ok();
    let r = planarian(&["snapshot", &sb.name]);
    r.ok();
    assert!(!r.stderr.contains("waiting for what is in flight"), "{}", r.stderr);
    assert!(std::fs::read_dir(&in_flight).is_ok_and(|mut d| d.next().is_none()), "no holder for a detached command");
    let sp2 = r.out();
    // (every process's command line: the image has no ps)
    let procs = |sb: &Sandbox| sb.sh("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done").stdout;
    sb.sh(
        "for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline)\" = 'sleep 600 ' ] && kill ${p#/proc/}; done; true",
    )
    .ok();
    // (a kill is delivered, not waited for: the process gone is)
    wait_for(Duration::from_secs(60), || !procs(&sb).contains("sleep 600"));
    let p = procs(&sb);
    assert!(!p.contains("sleep 600"), "stopped: {p}");
    sb.rollback(&sp2);
    let p = procs(&sb);
    assert!(p.contains("sleep 600"), "the statepoint holds the server running: {p}");
    // A tool call that runs on (its client attached) is waited for at most the bound: it does
    // not keep statepoints away for good.
    let _short = DropIn::new("zz-inflight", "[checkpoint]\nin_flight_wait_seconds = 3\n");
    let mut attached = std::process::Command::new("podman")
        .args(["--runtime", "planarian", "exec", &sb.name, "sleep", "700"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(300), || std::fs::read_dir(&in_flight).is_ok_and(|mut d| d.next().is_some())),
        "the attached exec's holder names it in {}",
        in_flight.display()
    );
    let r = planarian(&["snapshot", &sb.name]);
    r.ok();
    assert!(r.stderr.contains("waiting for what is in flight") && r.stderr.contains("sleep 700"), "{}", r.stderr);
    let sp3 = r.out();
    assert!(sb.statepoints().iter().any(|s| s["statepoint-id"] == sp3.as_str()), "{sp3} committed");
    // It is outside the container's tree (a child of conmon): the statepoint says it does not
    // hold it, on stderr and in the ledger; the one with the exec -d server says nothing.
    assert!(
        r.stderr.contains(&format!("{sp3} does not hold process")) && r.stderr.contains("(sleep 700)"),
        "{}",
        r.stderr
    );
    let ledger = planarian(&["ledger", &sb.name]).out();
    let line = |sp: &str| {
        ledger
            .lines()
            .find(|l| l.split_whitespace().any(|w| w.trim_end_matches('*') == sp))
            .unwrap_or_default()
            .to_string()
    };
    assert!(line(&sp3).contains("processes NOT covered: process") && line(&sp3).contains("sleep 700"), "{ledger}");
    assert!(!line(&sp2).contains("NOT covered") && line(&sp2).contains(&sp2), "{ledger}");
    let p = procs(&sb);
    assert!(p.contains("sleep 700"), "the command runs on: {p}");
    let _ = attached.kill();
    let _ = attached.wait();
    // A rollback to that statepoint tells what the model reads: the process is not restored.
    let back = planarian(&["rollback", "--json", &sb.name, &sp3]);
    back.ok();
    let ctx: serde_json::Value = serde_json::from_str(&back.out()).unwrap();
    assert!(ctx["not-held"][0].as_str().is_some_and(|l| l.contains("(sleep 700)")), "{ctx}");
    assert!(ctx["text"].as_str().unwrap().contains("Process NOT restored: process"), "{ctx}");
    let p = procs(&sb);
    assert!(!p.contains("sleep 700") && p.contains("sleep 600"), "the statepoint's processes, no other: {p}");
}
