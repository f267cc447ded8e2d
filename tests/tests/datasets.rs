//! The files of statepoints on ZFS datasets (zfs-fuse in the guest, a pool on a file): exact
//! rollback in any order on a per-image clone and on a `--rootfs` dataset, the image base shared
//! between containers, fork as a clone, removal, and the faults (pool full, dataset busy, zfs
//! missing).

use planarian_system_tests::sandbox::{Ctr, Sandbox};
use planarian_system_tests::*;
use std::time::Duration;

fn pool() -> Option<String> {
    zfs_test_pool()
}

fn zfs(args: &[&str]) -> Run {
    cmd("zfs", args)
}

fn prop(name: &str, p: &str) -> String {
    zfs(&["get", "-H", "-p", "-o", "value", p, name]).ok().out()
}

fn exists(name: &str) -> bool {
    zfs(&["list", "-H", "-t", "all", name]).code == Some(0)
}

fn snapshots_matching(pool: &str, needle: &str) -> Vec<String> {
    zfs(&["list", "-H", "-o", "name", "-t", "snapshot", "-r", pool])
        .out()
        .lines()
        .filter(|l| l.contains(needle))
        .map(String::from)
        .collect()
}

/// `zfs destroy ARGS`, tried again while the dataset is busy: on zfs-fuse a mount namespace made
/// meanwhile (a container's or CRIU's, by a test beside this one) holds a copy of its mount until
/// it lets it go. Any other failure fails at once.
fn destroy(args: &[&str]) {
    let (mut last, mut tried, started) = (None, None, std::time::Instant::now());
    let destroyed = wait_for(Duration::from_secs(60), || {
        let r = zfs(&[&["destroy"], args].concat());
        assert!(r.code == Some(0) || r.stderr.contains("busy"), "zfs destroy {args:?}: {r:?}");
        let done = r.code == Some(0);
        if !done {
            tried = Some(r.stderr.trim().to_string());
        }
        last = Some(r);
        done
    });
    assert!(destroyed, "zfs destroy {args:?}: still busy: {last:?}");
    if let Some(busy) = tried.filter(|_| started.elapsed() > Duration::from_secs(1)) {
        eprintln!("zfs destroy {args:?}: busy for {:?} ({busy})", started.elapsed());
    }
}

fn id_of(name: &str) -> String {
    podman("planarian", &["inspect", "--format", "{{.Id}}", name]).ok().out()
}

/// What Podman bind-mounts over the rootfs (and rewrites at every restore): not the container's files.
const PODMAN_FILES: &str = "! -path /etc/hosts ! -path /etc/hostname ! -path /etc/resolv.conf";

/// Checksums of the files an agent changes, seen from inside the container.
fn files(sb: &Sandbox) -> String {
    sb.sh(&format!("find /work /etc -xdev -type f {PODMAN_FILES} 2>/dev/null | sort | xargs md5sum")).ok().out()
}

fn status(name: &str) -> String {
    podman("planarian", &["inspect", "--format", "{{.State.Status}}", name]).out()
}

#[test]
fn per_image_clone_rolls_back_exactly_in_any_order_and_shares_the_image() {
    require_stack!();
    let Some(pool) = pool() else { return };
    let parent = zfs_parent(&pool);
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let mut sb = Sandbox::start("zfs", 8, &["--annotation", &ann]);
    let id = sb.id();
    let ds = format!("{parent}/ctr-{id}");
    let origin = prop(&ds, "origin");
    assert!(
        origin.starts_with(&format!("{parent}/image-")) && origin.ends_with("@base"),
        "the container's dataset is a clone of the image's base: {origin}"
    );
    let root = sb.sh("grep ' / ' /proc/mounts").ok().out();
    assert!(root.contains(&ds), "the container runs on its dataset: {root}");

    sb.sh("mkdir -p /work && echo one > /work/a && echo keep > /work/k && rm /etc/debian_version").ok();
    let c1 = sb.send("tick");
    let f1 = files(&sb);
    sb.snapshot("z1");
    sb.sh("echo two > /work/a && echo new > /work/b && rm /work/k && echo x >> /etc/os-release").ok();
    let c2 = sb.send("dirty 0 65536");
    let f2 = files(&sb);
    sb.snapshot("z2");
    sb.sh("rm -rf /work && echo three > /etc/motd && mkdir /work && echo 3 > /work/3").ok();
    let c3 = sb.send("tick");
    let f3 = files(&sb);
    sb.snapshot("z3");
    sb.sh("echo after > /etc/after && rm /work/3").ok();

    let m = sb.manifest("sp1");
    assert_eq!(m["local-state"]["rootfs-backend"], "zfs", "{m}");
    let snap1 = m["local-state"]["zfs-snapshot"].as_str().unwrap().to_string();
    assert_eq!(snap1, format!("{ds}@planarian-{}-sp1", &id[..12]));
    assert_eq!(m["measurements"]["rootfs-bytes"], 0, "no file was copied: {m}");
    assert_ne!(f1, f2);
    assert_ne!(f2, f3);

    for (sp, f, c) in [("z2", &f2, &c2), ("z1", &f1, &c1), ("z3", &f3, &c3), ("z1", &f1, &c1)] {
        sb.rollback(sp);
        assert_eq!(&files(&sb), f, "files after rollback to {sp}");
        assert_eq!(&sb.state(), c, "memory after rollback to {sp}");
        for n in 1..=3 {
            assert_eq!(
                snapshots_matching(&pool, &format!("@planarian-{}-sp{n}", &id[..12])).len(),
                1,
                "statepoint sp{n} keeps its snapshot"
            );
        }
    }
    assert!(sb.sh("test -e /etc/after").code != Some(0));
    // Retired datasets holding no statepoint are gone: at most the ones with newer snapshots stay.
    let family = zfs(&["list", "-H", "-o", "name", "-t", "filesystem", "-r", &parent]).out();
    assert!(family.lines().filter(|l| l.starts_with(&format!("{ds}.planarian-old-"))).count() <= 2, "{family}");

    // A second container of the image copies nothing: it is a clone of the same base.
    let used0: u64 = prop(&pool, "used").parse().unwrap();
    let base_used: u64 = prop(origin.split('@').next().unwrap(), "used").parse().unwrap();
    let sb2 = Sandbox::start("zfs2", 8, &["--annotation", &ann]);
    let ds2 = format!("{parent}/ctr-{}", sb2.id());
    assert_eq!(prop(&ds2, "origin"), origin);
    let used1: u64 = prop(&pool, "used").parse().unwrap();
    eprintln!(
        "image base {base_used} bytes; pool grew by {} bytes for the second container",
        used1.saturating_sub(used0)
    );
    assert!(base_used > 50 << 20, "the base holds the image: {base_used}");
    assert!(used1.saturating_sub(used0) < base_used / 20, "second container wrote {} bytes", used1 - used0);

    // Removing a container removes its dataset and nothing else.
    let name2 = sb2.name.clone();
    drop(sb2);
    assert!(podman("planarian", &["inspect", &name2]).code != Some(0));
    assert!(wait_for(Duration::from_secs(120), || !exists(&ds2)), "{ds2} removed with its container");
    assert!(exists(&ds) && exists(&origin), "the other container and the image base stay");
    assert_eq!(files(&sb), f1);
}

/// The image's base made by its first container's `create` and by `planarian zfs-base` is one and
/// the same (same dataset, found either way), and a bad image changes nothing.
#[test]
fn the_image_base_is_made_by_the_first_create_or_ahead_by_zfs_base() {
    require_stack!();
    let Some(pool) = pool() else { return };
    let parent = format!("{pool}/sbbase{}", std::process::id());
    zfs(&["create", &parent]).ok();
    let _cleanup = Defer(|| drop(zfs(&["destroy", "-r", &parent])));
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let name = name("zfsbase");
    let _gone = Cleanup(name.clone());

    // Made by create: the first container of the image, with no base under this parent yet.
    podman(
        "planarian",
        &["run", "-d", "--name", &name, "--network", "none", "--annotation", &ann, BUSYBOX, "sleep", "600"],
    )
    .ok();
    let origin = prop(&format!("{parent}/ctr-{}", id_of(&name)), "origin");
    assert!(origin.starts_with(&format!("{parent}/image-")) && origin.ends_with("@base"), "{origin}");
    // zfs-base finds that very base: the key it computes from the image equals the one create
    // computed from the container's overlay.
    let again = planarian(&["zfs-base", BUSYBOX, "--parent-dataset", &parent]);
    again.ok();
    assert_eq!(again.out(), format!("{origin}: {BUSYBOX} was copied before"));

    // Made ahead: under a second parent, zfs-base copies the image, and a container's create
    // clones it instead of copying.
    let parent2 = format!("{parent}/ahead");
    zfs(&["create", &parent2]).ok();
    let made = planarian(&["zfs-base", BUSYBOX, "--parent-dataset", &parent2]);
    made.ok();
    let base2 = format!("{parent2}/{}", origin.strip_prefix(&format!("{parent}/")).unwrap());
    assert!(made.out().starts_with(&format!("{base2}: {BUSYBOX} copied (")), "{}", made.out());
    let name2 = planarian_system_tests::name("zfsbase");
    let _gone2 = Cleanup(name2.clone());
    let ann2 = format!("io.planarian.zfs.parent_dataset={parent2}");
    podman(
        "planarian",
        &["run", "-d", "--name", &name2, "--network", "none", "--annotation", &ann2, BUSYBOX, "sleep", "600"],
    )
    .ok();
    assert_eq!(prop(&format!("{parent2}/ctr-{}", id_of(&name2)), "origin"), base2);
    assert_eq!(podman("planarian", &["exec", &name2, "cat", "/etc/hostname"]).code, Some(0));

    // Bad input: one clear line, nothing made.
    let before = zfs(&["list", "-H", "-o", "name", "-t", "all", "-r", &parent]).out();
    let bad = planarian(&["zfs-base", "localhost/planarian-test/no-such-image", "--parent-dataset", &parent]);
    assert_ne!(bad.code, Some(0));
    assert_eq!(bad.stderr.trim().lines().count(), 1, "{bad:?}");
    assert!(bad.stderr.contains("no-such-image"), "{bad:?}");
    let missing = planarian(&["zfs-base", BUSYBOX, "--parent-dataset", &format!("{parent}/missing")]);
    assert_ne!(missing.code, Some(0));
    assert_eq!(missing.stderr.trim().lines().count(), 1, "{missing:?}");
    assert_eq!(zfs(&["list", "-H", "-o", "name", "-t", "all", "-r", &parent]).out(), before);
}

/// Runs a closure when dropped (cleanup that also runs when an assertion fails).
struct Defer<F: FnMut()>(F);
impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

#[test]
fn rootfs_on_a_dataset_rolls_back_and_the_dataset_stays_the_users() {
    require_stack!();
    let Some(pool) = pool() else { return };
    let ds = format!("{pool}/rootfs-{}", std::process::id());
    zfs(&["create", &ds]).ok();
    let mp = prop(&ds, "mountpoint");
    // The busybox test image's tree, as Podman has it.
    let image = podman("planarian", &["image", "mount", BUSYBOX]).ok().out();
    cmd("cp", ["-a", &format!("{image}/."), &mp]).ok();
    podman("planarian", &["image", "unmount", BUSYBOX]).ok();
    let name = name("zfsroot");
    let _c = Cleanup(name.clone());
    podman(
        "planarian",
        &[
            "run",
            "--network",
            "none",
            "-d",
            "--name",
            &name,
            "--rootfs",
            &mp,
            "sh",
            "-c",
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 1; done",
        ],
    )
    .ok();
    let id = id_of(&name);
    let ctr = Ctr::new(&name);
    let sh = |s: &str| ctr.sh(s);
    let sums = || sh(&format!("find /data /etc -type f {PODMAN_FILES} | sort | xargs md5sum")).ok().out();
    sh("mkdir /data && echo 1 > /data/f && rm /etc/group").ok();
    let f1 = sums();
    planarian(&["snapshot", &name, "--name", "r1"]).ok();
    sh("echo 2 > /data/f && echo g > /etc/group && echo n > /data/new").ok();
    let f2 = sums();
    planarian(&["snapshot", &name, "--name", "r2"]).ok();
    sh("rm -rf /data").ok();
    // (back past r2, then forward to it: both directions)
    for (sp, f) in [("r1", &f1), ("r2", &f2)] {
        planarian(&["rollback", &name, sp]).ok();
        assert_eq!(status(&name), "running");
        assert_eq!(&sums(), f, "files after rollback to {sp}");
        assert!(
            wait_for(Duration::from_secs(120), || sh("cat /tmp/n").code == Some(0)),
            "the process runs after rollback to {sp}"
        );
    }
    assert_eq!(prop(&ds, "mountpoint"), mp, "same dataset name, same path");
    assert_eq!(cmd("cat", [format!("{mp}/data/f")]).out(), "2", "the host sees the rolled-back files at the same path");
    podman("planarian", &["rm", "-f", "-t", "0", &name]).ok();
    let ours = || snapshots_matching(&pool, &format!("@planarian-{}-", &id[..12]));
    assert!(
        wait_for(Duration::from_secs(120), || ours().is_empty()),
        "planarian's snapshots go with the container: left {:?}, gc said {:?}; holds {}",
        ours(),
        std::fs::read_to_string(format!("/var/lib/planarian/containers/{id}/gc-error")),
        zfs(&[&["holds", "-H"], &ours().iter().map(String::as_str).collect::<Vec<_>>()[..]].concat()).stdout
    );
    assert!(exists(&ds), "the user's dataset stays");
    destroy(&["-r", &ds]);
}

/// A rollback in place on ZFS puts back exactly the statepoint's tree: every entry's type,
/// mode, owner, size, times (directories' too) and content, after files were changed, appended,
/// removed (a directory at the root too), renamed, re-typed, created in new directories. Only the
/// places of the objects that changed are examined, found through the znodes the incremental
/// stream carries; where that needs more than a bounded search (a file deep below directories
/// nothing else changed near), zdb tells, and the next time the place is known. A file with two
/// names that changed makes it compare every directory, with the same result.
#[test]
fn a_rollback_in_place_on_zfs_puts_back_exactly_the_tree() {
    require_stack!();
    let Some(pool) = pool() else { return };
    let parent = zfs_parent(&pool);
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let mut sb = Sandbox::start("zfsinplace", 8, &["--annotation", &ann]);
    sb.sh("mkdir -p /work/a/b/c /work/d /work/e/f && for i in $(seq 1 100); do echo $i > /work/a/b/f$i; done \
           && echo x > /work/a/b/c/deep && echo top > /work/d/top && ln -s ../d /work/e/l && echo h > /work/hard && ln /work/hard /work/d/hard2 \
           && mkfifo /work/fifo && chmod 751 /work/d && mkdir /proj && echo p > /proj/x \
           && mkdir -p /deep/x1/x2/x3/x4 /wide && for i in $(seq 100 299); do mkdir /wide/d$i; done \
           && echo d > /deep/x1/x2/x3/x4/file && for i in $(seq 100 139); do mkdir /wide/e$i; done")
        .ok();
    let tree = |sb: &Sandbox| {
        let (dirs, skip) =
            ("/work /proj /root /etc /deep", "! -path /etc/hosts ! -path /etc/hostname ! -path /etc/resolv.conf");
        sb.sh(&format!("ls -a / && find {dirs} -xdev {skip} -printf '%p %y %m %U:%G %s %T@ %l\\n' | sort && find {dirs} -xdev -type f {skip} | sort | xargs md5sum")).ok().out()
    };
    let made = std::time::Instant::now();
    let before = tree(&sb);
    let at = sb.send("tick");
    // Objects last changed two seconds and more before a statepoint are the stream's
    // neighbours, not changes: the statepoint comes that long after the tree was made, however
    // fast this machine made it (else, places found here depend on its speed).
    assert!(wait_for(Duration::from_secs(10), || made.elapsed() > Duration::from_secs(3)));
    let sp = sb.snapshot("tree");
    // Changes of every kind; the file with two names is left alone this time.
    sb.sh("echo more >> /work/a/b/c/deep && rm /work/a/b/f7 && echo new > /work/d/new && mv /work/e/f /work/moved \
           && chmod 600 /work/a/b/f20 && touch -d 2001-01-01 /work/a/b/f21 && rm /work/e/l && mkdir /work/e/l && echo in > /work/e/l/x \
           && mkdir -p /work/n/m && echo p > /work/n/m/p && mv /work/d/top /work/top2 && rm /work/fifo && echo f > /work/fifo \
           && echo root >> /root/.profile && rm /etc/issue && rm -r /proj && touch /newtop")
        .ok();
    sb.send("dirty 0 65536");
    assert_ne!(tree(&sb), before);
    let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
    r.ok();
    let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
    assert_eq!(how["path"], "in-place", "{how}");
    assert!(how["places-examined"].as_u64().is_some_and(|n| n > 0), "only the changed objects' places examined: {how}");
    assert_eq!(how["places-from"], "stream", "{how}");
    sb.seq = sb.read().expect("state").0;
    assert_eq!(tree(&sb), before, "the tree after the rollback in place");
    assert_eq!(sb.send("tick").checksum, at.checksum);

    // A file deep below directories that did not change, with nothing else changed near it
    // and hundreds of directories before it breadth first: zdb tells where it is; the second
    // time its directory is known. (Its directories were made before the 200 under /wide, the
    // file between those and 40 more: the stream carries each changed object's neighbours in
    // its block of znodes, and those are /wide's, not the file's directories.)
    let ds = format!("{parent}/ctr-{}", sb.id());
    // (the dataset's datasets and snapshots, and where they are mounted: the statepoint's view,
    // a mount of its snapshot on OpenZFS, must be gone too)
    let left = || {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let mounted = mounts
            .lines()
            .filter(|l| l.starts_with(&ds))
            .map(|l| l.split(' ').take(2).collect::<Vec<_>>().join(" on "));
        zfs(&["list", "-H", "-o", "name", "-t", "all", "-r", &parent])
            .out()
            .lines()
            .filter(|l| l.starts_with(&ds))
            .map(String::from)
            .chain(mounted)
            .collect::<Vec<_>>()
    };
    // (the dataset's own mount stays)
    let mount = left().into_iter().filter(|l| l.starts_with(&format!("{ds} on ")));
    let kept: Vec<String> =
        [ds.clone(), format!("{ds}@planarian-{}-{sp}", &sb.id()[..12])].into_iter().chain(mount).collect();
    assert_eq!(kept.len(), 3, "{kept:?}");
    for from in ["zdb", "stream"] {
        sb.sh("echo more >> /deep/x1/x2/x3/x4/file").ok();
        let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
        r.ok();
        let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
        assert_eq!((how["path"].as_str(), how["places-from"].as_str()), (Some("in-place"), Some(from)), "{how}");
        sb.seq = sb.read().expect("state").0;
        assert_eq!(tree(&sb), before, "the tree after the rollback in place (places from {from})");
    }

    // The file with two names changes: every directory is compared, to the same end.
    sb.sh("echo changed > /work/d/hard2 && rm -r /work/a/b /proj").ok();
    let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
    r.ok();
    let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
    assert_eq!((how["path"].as_str(), how["places-examined"].as_u64()), (Some("in-place"), None), "{how}");
    sb.seq = sb.read().expect("state").0;
    assert_eq!(tree(&sb), before, "the tree after the second rollback in place");
    assert_eq!(sb.sh("cat /work/hard; stat -c %h /work/hard").out(), "h\n2", "still one file with two names");

    // What the rollbacks left — the statepoint's view, the snapshot of the frozen state — is
    // removed after they answered; nothing else goes.
    assert!(wait_for(Duration::from_secs(120), || left() == kept), "{:?}", left());
}

/// A rollback in place on ZFS that fails before its point of no return (the compensation of
/// the remote state, its first change) leaves the sandbox as it was; one that fails after it
/// goes forward, by a restore, to exactly the statepoint. Either way nothing of the rollback
/// stays in the pool or mounted: the snapshot of the frozen state and the view its files were
/// compared with (a mount of the statepoint's snapshot on OpenZFS, a clone on zfs-fuse) are
/// removed. Then it goes back in place.
#[test]
fn a_failing_rollback_in_place_on_zfs_leaves_the_sandbox_and_the_pool_as_they_were() {
    require_stack!();
    let Some(pool) = pool() else { return };
    const FAULT: &str = "/run/planarian/fault";
    struct Disarm;
    impl Drop for Disarm {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(FAULT);
        }
    }
    let _d = Disarm;
    let parent = zfs_parent(&pool);
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let mut sb = Sandbox::start("zfsinfault", 8, &["--annotation", &ann]);
    let ds = format!("{parent}/ctr-{}", sb.id());
    // (the dataset's datasets and snapshots, and where they are mounted: the statepoint's view,
    // a mount of its snapshot on OpenZFS, must be gone too)
    let left = || {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        let mounted = mounts
            .lines()
            .filter(|l| l.starts_with(&ds))
            .map(|l| l.split(' ').take(2).collect::<Vec<_>>().join(" on "));
        zfs(&["list", "-H", "-o", "name", "-t", "all", "-r", &parent])
            .out()
            .lines()
            .filter(|l| l.starts_with(&ds))
            .map(String::from)
            .chain(mounted)
            .collect::<Vec<_>>()
    };
    sb.sh("echo then > /root/f").ok();
    // (a child of init at the statepoint: one that has ended since is what makes a rollback in
    // place refuse, below)
    sb.send("fork 5");
    let at = sb.send("tick");
    let sp = sb.snapshot("good");
    let kept = left();
    assert_eq!(kept.len(), 3, "the dataset, the statepoint's snapshot, the dataset's mount: {kept:?}");
    let before = sb.send("dirty 0 65536");
    let point = "rollback.in-place.compensating";
    sb.sh("echo now > /root/f").ok();
    std::fs::create_dir_all("/run/planarian").unwrap();
    std::fs::write(FAULT, point).unwrap();
    let r = planarian(&["rollback", &sb.name, &sp]);
    assert_ne!(r.code, Some(0), "{point}: {r:?}");
    assert!(r.stderr.contains(point), "{point}: {r:?}");
    assert!(!std::path::Path::new(FAULT).exists(), "{point}: the fault never fired");
    assert_eq!(status(&sb.name), "running", "{point}");
    sb.seq = sb.read().expect("state").0;
    let now = sb.send("tick");
    assert_eq!(
        (now.counter, &now.checksum),
        (before.counter + 1, &before.checksum),
        "{point}: the memory is not as it was"
    );
    assert_eq!(sb.sh("cat /root/f").out(), "now", "{point}: the files are not as they were");
    let list = sb.statepoints();
    let sps: Vec<&str> = list.iter().map(|m| m["statepoint-id"].as_str().unwrap_or("")).collect();
    assert_eq!(sps, vec![sp.as_str()], "{point}: only the statepoint stays");
    assert!(wait_for(Duration::from_secs(120), || left() == kept), "{point}: left in the pool: {:?}", left());
    for point in ["rollback.in-place.files", "rollback.in-place.memory"] {
        sb.send("dirty 0 65536");
        sb.sh("echo now > /root/f").ok();
        std::fs::write(FAULT, point).unwrap();
        let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
        r.ok();
        assert!(!std::path::Path::new(FAULT).exists(), "{point}: the fault never fired");
        let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
        assert_eq!(how["path"], "stop-and-restore", "{point}: {how}");
        assert!(how["not-in-place"].as_str().unwrap().contains(point), "{point}: {how}");
        sb.seq = sb.read().expect("state").0;
        assert_eq!(sb.send("tick").checksum, at.checksum, "{point}: the memory is the statepoint's");
        assert_eq!(sb.sh("cat /root/f").out(), "then", "{point}: the files are the statepoint's");
        assert_eq!(status(&sb.name), "running", "{point}");
        assert!(wait_for(Duration::from_secs(120), || left() == kept), "{point}: left in the pool: {:?}", left());
    }
    // A rollback the process tree's check refuses (a process of the statepoint has ended) goes
    // by a restore, to exactly the statepoint; the statepoint's view, begun before the check
    // (OpenZFS), goes with it.
    let pythons = |sb: &Sandbox| sb.sh("cat /proc/[0-9]*/comm").stdout.lines().filter(|l| *l == "python3").count();
    assert_eq!(pythons(&sb), 2, "init and its child");
    sb.send("dirty 0 65536");
    sb.sh("echo now > /root/f").ok();
    sb.send("reap");
    assert_eq!(pythons(&sb), 1, "the child has ended");
    let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
    r.ok();
    let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
    assert_eq!(how["path"], "stop-and-restore", "{how}");
    assert!(how["not-in-place"].as_str().unwrap().contains("has ended"), "{how}");
    sb.seq = sb.read().expect("state").0;
    assert_eq!(sb.send("tick").checksum, at.checksum, "refused: the memory is the statepoint's");
    assert_eq!(sb.sh("cat /root/f").out(), "then", "refused: the files are the statepoint's");
    assert_eq!(pythons(&sb), 2, "refused: the child is back");
    assert!(wait_for(Duration::from_secs(120), || left() == kept), "refused: left in the pool: {:?}", left());
    // planarian killed while it writes the memory, the statepoint's view mounted and the frozen
    // state's snapshot taken: the next operation finishes the rollback by a restore, to exactly
    // the statepoint, whatever the killed one left in the way; then nothing of it stays.
    sb.send("dirty 0 65536");
    sb.sh("echo now > /root/f").ok();
    std::fs::write(FAULT, "kill:rollback.in-place.memory").unwrap();
    let r = planarian(&["rollback", &sb.name, &sp]);
    assert!(r.code.is_none() || r.code == Some(137), "killed: {r:?}");
    assert!(!std::path::Path::new(FAULT).exists(), "the kill never fired");
    // (what it left: the frozen state's snapshot, and the statepoint's view — on OpenZFS its
    // snapshot mounted beside the store, on zfs-fuse a clone)
    let after_kill = left();
    assert!(after_kill.contains(&format!("{ds}@planarian-inplace-now")), "{after_kill:?}");
    let view_left = match zfs(&["version"]).code == Some(0) {
        true => after_kill.iter().any(|l| l.starts_with(&format!("{ds}@")) && l.ends_with("/in-place-files")),
        false => after_kill.contains(&format!("{ds}.planarian-inplace")),
    };
    assert!(view_left, "the killed rollback's view: {after_kill:?}");
    assert!(wait_for(Duration::from_secs(120), || status(&sb.name) == "exited"), "{}", status(&sb.name));
    let r = planarian(&["rollback", &sb.name, &sp]);
    r.ok();
    assert!(r.stderr.contains(&format!("an interrupted rollback to {sp} was finished")), "{}", r.stderr);
    assert_eq!(status(&sb.name), "running", "killed");
    sb.seq = sb.read().expect("state").0;
    assert_eq!(sb.send("tick").checksum, at.checksum, "killed: the memory is the statepoint's");
    assert_eq!(sb.sh("cat /root/f").out(), "then", "killed: the files are the statepoint's");
    assert!(wait_for(Duration::from_secs(120), || left() == kept), "killed: left in the pool: {:?}", left());
    sb.send("dirty 0 65536");
    sb.sh("echo now > /root/f").ok();
    let r = planarian(&["rollback", &sb.name, &sp, "--json"]);
    r.ok();
    let how: serde_json::Value = serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["how"].clone();
    assert_eq!(how["path"], "in-place", "{how}");
    sb.seq = sb.read().expect("state").0;
    assert_eq!(sb.send("tick").checksum, at.checksum);
    assert_eq!(sb.sh("cat /root/f").out(), "then");
    assert!(wait_for(Duration::from_secs(120), || left() == kept), "left in the pool: {:?}", left());
}

#[test]
fn fork_is_a_clone_independent_of_its_source_in_both_directions() {
    require_stack!();
    let Some(pool) = pool() else { return };
    let parent = zfs_parent(&pool);
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let mut src = Sandbox::start("zfsfork", 8, &["--annotation", &ann]);
    let src_id = src.id();
    src.sh("mkdir -p /work && echo one > /work/a").ok();
    src.snapshot("f1");
    src.sh("echo two > /work/a && echo b > /work/b").ok();
    let c2 = src.send("tick");
    let f2 = files(&src);
    src.snapshot("f2");
    src.sh("echo three > /work/a").ok();

    let fork = name("zfsfork-new");
    planarian(&["fork", &src.name, "f2", "--name", &fork]).ok();
    let mut fk = Sandbox::attach(&fork);
    let fork_id = id_of(&fork);
    let fork_ds = format!("{parent}/ctr-{fork_id}");
    assert_eq!(
        prop(&fork_ds, "origin"),
        format!("{parent}/ctr-{src_id}@planarian-{}-sp2", &src_id[..12]),
        "the fork's files are a clone"
    );
    assert_eq!(files(&fk), f2);
    assert_eq!(fk.state(), c2);

    fk.sh("echo fork > /work/only-fork").ok();
    src.sh("echo src > /work/only-src").ok();
    assert!(src.sh("test -e /work/only-fork").code != Some(0));
    assert!(fk.sh("test -e /work/only-src").code != Some(0));
    assert_eq!(src.sh("cat /work/a").out(), "three");
    assert_eq!(fk.sh("cat /work/a").out(), "two");

    // In place nothing is swapped: the source goes back to f1 while the fork runs on, untouched.
    let r = planarian(&["rollback", &src.name, "f1", "--json"]);
    r.ok();
    assert!(r.stdout.contains("\"in-place\""), "{}", r.stdout);
    src.seq = src.read().expect("state").0;
    assert_eq!(src.sh("cat /work/a; ls /work").out(), "one\na");
    assert_eq!(fk.sh("cat /work/a /work/only-fork").out(), "two\nfork");

    // While the fork runs on a clone of the source's snapshot, a rollback that stops and
    // restores swaps the source's dataset (`zfs rename`). zfs-fuse remounts the clone for that,
    // and cannot while the fork uses it: refused, changing nothing. OpenZFS leaves the clone
    // where it is: the source goes back, the fork runs on untouched.
    src.sh("echo three > /work/a").ok();
    let in_place_off = DropIn::new("in-place-off", "[checkpoint]\nrollback_in_place = false\n");
    if cmd("zfs", ["version"]).code == Some(0) {
        let r = planarian(&["rollback", &src.name, "f1", "--json"]);
        r.ok();
        assert!(r.stdout.contains("\"stop-and-restore\""), "{}", r.stdout);
        src.seq = src.read().expect("state").0;
        assert_eq!(src.sh("cat /work/a; ls /work").out(), "one\na");
        assert_eq!(fk.sh("cat /work/a /work/only-fork").out(), "two\nfork");
        assert_eq!(prop(&fork_ds, "mounted"), "yes");
    } else {
        let refused = planarian(&["rollback", &src.name, "f1"]);
        assert!(refused.code != Some(0) && refused.stderr.contains("run on clones of its snapshots"), "{refused:?}");
        assert_eq!(src.sh("cat /work/a; ls /work").out(), "three\na");
        assert_eq!(status(&src.name), "running");
    }
    drop(in_place_off);

    // The fork's statepoints work on its own dataset.
    fk.snapshot("k2");
    fk.sh("rm -rf /work").ok();
    fk.rollback("k2");
    assert_eq!(fk.sh("cat /work/only-fork").out(), "fork");

    // Removing the source's statepoint keeps the snapshot the fork depends on; removing the
    // source keeps the fork working.
    planarian(&["statepoint", "rm", &src.name, "f2"]).ok();
    let src_snaps = format!("@planarian-{}-", &src_id[..12]);
    assert!(!snapshots_matching(&pool, &format!("{src_snaps}sp2")).is_empty(), "kept while the fork depends on it");
    let src_name = src.name.clone();
    drop(src);
    assert!(podman("planarian", &["inspect", &src_name]).code != Some(0));
    let src_ds = format!("{parent}/ctr-{src_id}");
    assert!(wait_for(Duration::from_secs(120), || !exists(&src_ds)), "the source's dataset goes with it");
    assert_eq!(fk.sh("cat /work/a").out(), "two");
    let c = fk.send("tick");
    fk.snapshot("k3");
    fk.sh("echo later > /work/a").ok();
    // (by stop and restore: its dataset swapped, `zfs rename`, which zfs-fuse remounts for; the
    // one such rollback the zfs-fuse machine runs)
    {
        let _off = DropIn::new("in-place-off", "[checkpoint]\nrollback_in_place = false\n");
        let r = planarian(&["rollback", &fk.name, "k3", "--json"]);
        r.ok();
        assert!(r.stdout.contains("\"stop-and-restore\""), "{}", r.stdout);
        fk.seq = fk.read().expect("state").0;
    }
    assert_eq!(fk.sh("cat /work/a").out(), "two");
    assert_eq!(fk.state(), c);

    drop(fk);
    assert!(wait_for(Duration::from_secs(120), || !exists(&fork_ds)), "the fork's dataset goes with it");
    assert!(
        snapshots_matching(&pool, &src_snaps).is_empty(),
        "nothing of the source is left: {}",
        cmd("zfs", ["list", "-t", "all", "-o", "name,origin", "-r", &pool]).stdout
    );
}

#[test]
fn faults_pool_full_dataset_busy_zfs_missing_change_nothing() {
    require_stack!();
    if pool().is_none() {
        return;
    }
    // A small pool of its own, to fill.
    let pool = format!("plfull{}", std::process::id());
    let img = format!("/var/tmp/{pool}.img");
    cmd("truncate", ["-s", "128M", &img]).ok();
    cmd("zpool", ["create", "-m", &format!("/{pool}"), &pool, &img]).ok();
    struct Pool(String, String);
    impl Drop for Pool {
        fn drop(&mut self) {
            let _ = std::process::Command::new("zpool").args(["destroy", "-f", &self.0]).status();
            let _ = std::fs::remove_file(&self.1);
        }
    }
    let _pool = Pool(pool.clone(), img);
    // (zeros fill it: OpenZFS compresses by default, and a file of zeros then takes no space)
    zfs(&["set", "compression=off", &pool]).ok();
    // (no Debian base in a pool this small: the container here is busybox)
    let parent = format!("{pool}/sb");
    zfs(&["create", &parent]).ok();
    let name = name("zfsfault");
    let c = Cleanup(name.clone());
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    podman(
        "planarian",
        &[
            "run",
            "--network",
            "none",
            "-d",
            "--name",
            &name,
            "--annotation",
            &ann,
            BUSYBOX,
            "sh",
            "-c",
            "echo started; while :; do sleep 1; done",
        ],
    )
    .ok();
    let id = id_of(&name);
    let ds = format!("{parent}/ctr-{id}");
    let ctr = Ctr::new(&name);
    let sh = |s: &str| ctr.sh(s);
    sh("echo 1 > /f").ok();
    planarian(&["snapshot", &name, "--name", "b1"]).ok();
    sh("echo 2 > /f").ok();
    let committed = || planarian(&["statepoint", "list", &name, "--json"]).ok().out();

    // zfs missing: one clear line, no statepoint, the container runs on.
    {
        let _d = DropIn::new("zz-zfs-missing", "[runtime]\nzfs_path = \"/nonexistent/zfs\"\n");
        let before = committed();
        let r = podman("planarian", &["container", "checkpoint", "--leave-running", &name]);
        assert_ne!(r.code, Some(0));
        assert!(r.stderr.contains("zfs not found (looked in /nonexistent/zfs)"), "{}", r.stderr);
        assert_eq!(committed(), before);
        assert_eq!(status(&name), "running");
        let r = planarian(&["rollback", &name, "b1"]);
        assert_ne!(r.code, Some(0));
        assert!(r.stderr.contains("zfs not found"), "{}", r.stderr);
        assert_eq!(status(&name), "running");
        assert_eq!(sh("cat /f").out(), "2");
    }

    // A dataset busy at rollback: the rollback fails and the container is as it was.
    let mp = prop(&ds, "mountpoint");
    let mut holder = std::process::Command::new("sleep").arg("600").current_dir(&mp).spawn().unwrap();
    let r = planarian(&["rollback", &name, "b1"]);
    assert_ne!(r.code, Some(0));
    assert!(r.stderr.contains("busy"), "{}", r.stderr);
    assert!(r.stderr.contains("as they were before"), "{}", r.stderr);
    assert_eq!(status(&name), "running");
    assert_eq!(sh("cat /f").out(), "2", "the files are as they were before the rollback");
    let _ = holder.kill();
    let _ = holder.wait();
    planarian(&["rollback", &name, "b1"]).ok();
    assert_eq!(sh("cat /f").out(), "1");

    // The pool full during a snapshot: no statepoint, the container runs; with space back, the
    // next snapshot works and every statepoint is there.
    sh("dd if=/dev/zero of=/fill bs=1M 2>/dev/null; true").ok();
    let before = committed();
    let r = podman("planarian", &["container", "checkpoint", "--leave-running", &name]);
    assert_ne!(r.code, Some(0), "a snapshot into a full pool must fail");
    assert!(r.stderr.contains("is full"), "{}", r.stderr);
    assert_eq!(committed(), before, "no statepoint was committed");
    assert_eq!(status(&name), "running");
    assert_eq!(sh("cat /f").out(), "1");
    sh("rm /fill").ok();
    // zfs-fuse frees the blocks asynchronously.
    assert!(
        wait_for(Duration::from_secs(120), || planarian(&["snapshot", &name, "--name", "b2"]).code == Some(0)),
        "a snapshot works again once there is space"
    );
    planarian(&["rollback", &name, "b1"]).ok();
    assert_eq!(sh("cat /f").out(), "1");

    // Podman's tooling: logs, stop, start (on the same dataset, files kept), inspect.
    assert!(podman("planarian", &["logs", &name]).ok().out().contains("started"));
    podman("planarian", &["stop", "-t", "0", &name]).ok();
    podman("planarian", &["start", &name]).ok();
    assert_eq!(sh("cat /f").out(), "1");
    assert!(sh("grep ' / ' /proc/mounts").ok().out().contains(&ds), "a restarted container runs on its dataset");
    drop(c);
    assert!(wait_for(Duration::from_secs(120), || !exists(&ds)), "{ds} removed with its container");
}

/// On OpenZFS a snapshot, the incremental stream a rollback in place reads and whether a
/// snapshot exists (the rollback's check) go through libzfs_core, without a `zfs` process: the
/// library is found there (and not on zfs-fuse, which has none), the snapshot is the command's,
/// the stream carries the same objects as `zfs send -i`'s, existence is `zfs list`'s, and a
/// failure is typed as the command's.
#[test]
fn snapshots_and_streams_through_libzfs_core_are_the_command_lines() {
    let Some(pool) = pool() else { return };
    let openzfs = zfs(&["version"]).code == Some(0);
    assert_eq!(zfs::lzc::Core::get().is_some(), openzfs, "libzfs_core is used exactly on OpenZFS");
    let z = zfs::Zfs::new(cmd("sh", ["-c", "command -v zfs"]).ok().out());
    let ds = format!("{pool}/lzc-{}", std::process::id());
    zfs(&["create", &ds]).ok();
    let mnt = prop(&ds, "mountpoint");
    let dir = std::path::Path::new(&mnt);
    for i in 0..20 {
        std::fs::create_dir_all(dir.join(format!("d{}", i % 4))).unwrap();
        std::fs::write(dir.join(format!("d{}/f{i}", i % 4)), vec![i as u8; 5000 + i * 100]).unwrap();
    }
    z.snapshot(&format!("{ds}@a")).unwrap();
    // Three files rewritten, one made, one removed, a directory renamed.
    for i in [1, 6, 11] {
        std::fs::write(dir.join(format!("d{}/f{i}", i % 4)), b"changed").unwrap();
    }
    std::fs::write(dir.join("d0/new"), b"new").unwrap();
    std::fs::remove_file(dir.join("d2/f2")).unwrap();
    std::fs::rename(dir.join("d3"), dir.join("d3-renamed")).unwrap();
    nix::unistd::sync();
    z.snapshot(&format!("{ds}@b")).unwrap();
    assert!(exists(&format!("{ds}@a")) && exists(&format!("{ds}@b")));
    let (a, b) = (format!("{ds}@a"), format!("{ds}@b"));
    // Whether a dataset or snapshot exists: what `zfs list` says.
    let none = format!("{ds}@no-such");
    let no_ds = format!("{pool}/no-such-{}", std::process::id());
    for (name, there) in [(ds.as_str(), true), (a.as_str(), true), (none.as_str(), false), (no_ds.as_str(), false)] {
        assert_eq!(z.exists(name).unwrap(), there, "{name}: zfs list");
        if let Some(core) = zfs::lzc::Core::get() {
            assert_eq!(core.exists(name), there, "{name}: libzfs_core");
        }
    }
    let fast = z.changes(&a, &b).unwrap();
    let by_command = z.changes_by_command(&a, &b).unwrap();
    assert_eq!(fast, by_command, "the same objects, the same znodes");
    let ino = |p: &str| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(dir.join(p)).unwrap());
    for p in ["d1/f1", "d2/f6", "d3-renamed/f11", "d0/new", "d2", "d3-renamed"] {
        assert!(fast.objects.contains_key(&ino(p)), "{p} ({}) among {:?}", ino(p), fast.objects.keys());
    }
    // (an object beside a changed one in the same block of dnodes comes with it: the stream
    // carries blocks, not files; the rollback's comparison sorts them out)
    // Failures, typed as the command's.
    let again = z.snapshot(&b).unwrap_err();
    assert!(again.to_string().contains(&b), "{again}");
    let missing = z.snapshot(&format!("{pool}/no-such-{}@x", std::process::id())).unwrap_err();
    assert_eq!(missing.kind(), zfs::Kind::NotFound, "{missing}");
    let no_stream = z.changes(&b, &format!("{ds}@no-such")).unwrap_err();
    if openzfs {
        assert_eq!(no_stream.kind(), zfs::Kind::NotFound, "{no_stream}");
    }
    // (the command's first line of stderr does not say "does not exist" for it: an error all the same)
    assert!(z.changes_by_command(&b, &format!("{ds}@no-such")).is_err());
    destroy(&["-r", &ds]);
}

/// A read-only clone (what a rollback in place on zfs-fuse reads the statepoint's files from) is
/// what `zfs clone -o mountpoint=… -o readonly=on` makes: mounted there read-only with the
/// snapshot's files, its properties set,
/// destroyed (and unmounted) by `zfs destroy`; a clone of a snapshot that is not there is "not
/// found" and leaves nothing.
#[test]
fn a_read_only_clone_is_the_commands() {
    let Some(pool) = pool() else { return };
    let z = zfs::Zfs::new(cmd("sh", ["-c", "command -v zfs"]).ok().out());
    let ds = format!("{pool}/ro-{}", std::process::id());
    zfs(&["create", &ds]).ok();
    let dir = std::path::PathBuf::from(prop(&ds, "mountpoint"));
    std::fs::create_dir_all(dir.join("d")).unwrap();
    std::fs::write(dir.join("d/f"), b"at the snapshot").unwrap();
    nix::unistd::sync();
    zfs(&["snapshot", &format!("{ds}@s")]).ok();
    std::fs::write(dir.join("d/f"), b"after it").unwrap();
    let at = std::env::temp_dir().join(format!("planarian-ro-{}", std::process::id()));
    std::fs::create_dir_all(&at).unwrap();
    let view = format!("{ds}-view");
    z.clone_read_only(&format!("{ds}@s"), &view, &at).unwrap();
    assert_eq!(std::fs::read(at.join("d/f")).unwrap(), b"at the snapshot");
    // (zfs-fuse keeps the clone read-only in its daemon, but shows neither the property nor a
    // read-only mount: `readonly` is "off, temporary" there even after `zfs set readonly=on`)
    let openzfs = zfs(&["version"]).code == Some(0);
    if openzfs {
        assert_eq!(prop(&view, "readonly"), "on");
    }
    assert_eq!(prop(&view, "origin"), format!("{ds}@s"));
    assert_eq!(std::path::PathBuf::from(prop(&view, "mountpoint")), at);
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let line = mounts.lines().find(|l| l.split(' ').nth(1) == at.to_str()).expect("mounted there");
    assert!(line.starts_with(&format!("{view} ")), "{line}");
    let opts = line.split(' ').nth(3).unwrap();
    assert!(!openzfs || opts.split(',').any(|o| o == "ro"), "{line}");
    let w = std::fs::write(at.join("d/f"), b"x").unwrap_err();
    assert_eq!(w.raw_os_error(), Some(nix::libc::EROFS), "{w}");
    // A second clone of the same name fails and leaves the first as it was.
    assert!(z.clone_read_only(&format!("{ds}@s"), &view, &at).is_err());
    assert_eq!(std::fs::read(at.join("d/f")).unwrap(), b"at the snapshot");
    destroy(&[&view]);
    assert!(!exists(&view));
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(!mounts.lines().any(|l| l.split(' ').nth(1) == at.to_str()), "unmounted by zfs destroy");
    let missing = z.clone_read_only(&format!("{ds}@no-such"), &view, &at).unwrap_err();
    assert_eq!(missing.kind(), zfs::Kind::NotFound, "{missing}");
    assert!(!exists(&view), "nothing left");
    destroy(&["-r", &ds]);
    let _ = std::fs::remove_dir(&at);
}

/// On OpenZFS a rollback in place reads the statepoint's files from its snapshot, mounted as it
/// is by mount(2) as `.zfs/snapshot` mounts it: the snapshot's files, read-only (EROFS), the
/// snapshot busy while it is mounted and destroyed once `unmount_at` has unmounted it; a snapshot
/// that is not there is "not found" and mounts nothing. zfs-fuse mounts no snapshot (its kernel
/// has no `zfs` file system): the engine, asking `kernel_zfs`, clones there instead.
#[test]
fn a_snapshot_mounted_as_it_is_is_its_files_read_only() {
    let Some(pool) = pool() else { return };
    let openzfs = zfs(&["version"]).code == Some(0);
    assert_eq!(zfs::kernel_zfs(), openzfs, "the kernel's ZFS is OpenZFS's");
    let ds = format!("{pool}/snapmount-{}", std::process::id());
    zfs(&["create", &ds]).ok();
    let dir = std::path::PathBuf::from(prop(&ds, "mountpoint"));
    std::fs::create_dir_all(dir.join("d")).unwrap();
    std::fs::write(dir.join("d/f"), b"at the snapshot").unwrap();
    let snap = format!("{ds}@s");
    zfs(&["snapshot", &snap]).ok();
    std::fs::write(dir.join("d/f"), b"after it").unwrap();
    let at = std::env::temp_dir().join(format!("planarian-snapmount-{}", std::process::id()));
    std::fs::create_dir_all(&at).unwrap();
    let mounted_at = || {
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
        mounts.lines().find(|l| l.split(' ').nth(1) == at.to_str()).map(String::from)
    };
    if !openzfs {
        assert!(zfs::mount_snapshot(&snap, &at).is_err(), "zfs-fuse mounts no snapshot");
        assert_eq!(mounted_at(), None);
        destroy(&["-r", &ds]);
        let _ = std::fs::remove_dir(&at);
        return;
    }
    zfs::mount_snapshot(&snap, &at).unwrap();
    // (unmounted whatever happens below, or the dataset could not go)
    let _unmount = Defer(|| while zfs::unmount_at(&at).is_ok() {});
    assert_eq!(std::fs::read(at.join("d/f")).unwrap(), b"at the snapshot");
    assert_eq!(std::fs::read(dir.join("d/f")).unwrap(), b"after it", "the live dataset untouched");
    let line = mounted_at().expect("mounted there");
    assert!(line.starts_with(&format!("{snap} ")), "{line}");
    let opts: Vec<&str> = line.split(' ').nth(3).unwrap().split(',').collect();
    for o in ["ro", "nosuid", "nodev", "noexec"] {
        assert!(opts.contains(&o), "{o}: {line}");
    }
    let w = std::fs::write(at.join("d/f"), b"x").unwrap_err();
    assert_eq!(w.raw_os_error(), Some(nix::libc::EROFS), "{w}");
    let busy = zfs(&["destroy", &snap]);
    assert_ne!(busy.code, Some(0), "a mounted snapshot is kept: {busy:?}");
    assert!(exists(&snap));
    zfs::unmount_at(&at).unwrap();
    assert_eq!(mounted_at(), None, "unmounted");
    assert_eq!(zfs::unmount_at(&at), Err(nix::libc::EINVAL), "nothing is mounted there any more");
    zfs(&["destroy", &snap]).ok();
    assert!(!exists(&snap));
    let missing = zfs::mount_snapshot(&format!("{ds}@no-such"), &at).unwrap_err();
    assert_eq!(missing.kind(), zfs::Kind::NotFound, "{missing}");
    assert_eq!(mounted_at(), None, "nothing mounted");
    destroy(&["-r", &ds]);
    let _ = std::fs::remove_dir(&at);
}
