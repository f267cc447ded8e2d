//! `planarian fork`: new containers running from a statepoint, independent of each other and of
//! the source, each snapshotting incrementally and rolling back within its own branch; and
//! `planarian spare`, forks made ahead of time that a fork takes.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;

/// A fork, and the path it took (`how` of its restore context: "spare" when it was one).
fn fork(src: &Sandbox, sp: &str, tag: &str) -> (Sandbox, Option<String>) {
    let new = name(tag);
    let r = cmd(planarian_bin().to_str().unwrap(), ["fork", &src.name, sp, "--name", &new, "--json"]);
    r.ok();
    let ctx: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!((ctx["container"].as_str(), ctx["operation"].as_str()), (Some(new.as_str()), Some("fork")), "{ctx}");
    assert_eq!(status(&new).out(), "running");
    (Sandbox::attach(&new), ctx["how"]["path"].as_str().map(String::from))
}

/// The spares of `sp` registered in `src`'s store.
fn registered_spares(src: &Sandbox, sp: &str) -> Vec<std::path::PathBuf> {
    let id = src.id();
    let dir = std::path::Path::new("/var/lib/planarian/containers").join(id).join("spares").join(sp);
    std::fs::read_dir(dir).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

fn status(name: &str) -> Run {
    podman("planarian", &["inspect", "--format", "{{.State.Status}}", name])
}

/// Whether container `name` runs, its cgroup frozen (a spare planarian holds).
fn held_frozen(name: &str) -> bool {
    status(name).out() == "running" && cgroup_frozen(name)
}

/// `planarian spare CTR SP --count N`: the spares' names.
fn spare(src: &Sandbox, sp: &str, count: u32) -> Vec<String> {
    let out =
        cmd(planarian_bin().to_str().unwrap(), ["spare", &src.name, sp, "--count", &count.to_string()]).ok().out();
    out.lines().map(|l| l.split(' ').next().unwrap().to_string()).collect()
}

/// A fork runs from an OCI config of its own (planarian writes it from the source's): no ID of
/// the source's in it, and the files Podman mounts into it (`/etc/hosts`) are its own. Returns
/// its bundle.
fn assert_own_bundle(fork: &mut Sandbox, src: &Sandbox) -> std::path::PathBuf {
    let (id, src_id) = (fork.id(), src.id());
    let dirs =
        podman("planarian", &["inspect", "--format", "{{.StaticDir}} {{.GraphDriver.Data.UpperDir}}", &fork.name]);
    let (bundle, upper) = dirs.out().split_once(' ').map(|(b, u)| (b.to_string(), u.to_string())).unwrap();
    let config = std::fs::read_to_string(std::path::Path::new(&bundle).join("config.json")).unwrap();
    // (its ID's first 12 and 32 characters are names too: the host name, systemd's container_uuid)
    assert!(config.contains(&id) && !config.contains(&src_id[..12]), "{}: {config}", fork.name);
    assert!(!config.contains(&src_id[12..32]), "{}: {config}", fork.name);
    let layer = std::path::Path::new(&upper).parent().unwrap().file_name().unwrap().to_str().unwrap();
    let root: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert!(
        root["root"]["path"].as_str().unwrap().contains(layer),
        "{}: its root is not its layer's: {config}",
        fork.name
    );
    let mounts = fork.sh("cat /proc/self/mountinfo").ok().stdout.clone();
    let hosts = mounts.lines().find(|l| l.split(' ').nth(4) == Some("/etc/hosts")).unwrap_or_default();
    assert!(hosts.contains(&id), "{}: /etc/hosts is not its own: {hosts}", fork.name);
    assert!(!mounts.contains(&src_id[..12]), "{}: {mounts}", fork.name);
    bundle.into()
}

#[test]
fn forks_of_one_statepoint_diverge_and_the_source_is_untouched() {
    require_stack!();
    let mut src = Sandbox::start("fsrc", 32, &[]);
    src.sh("echo base > /root/f").ok();
    let at_sp = src.send("tick");
    let sp = src.snapshot("fork-point");
    src.send("dirty 0 65536");
    src.sh("echo src > /root/f").ok();
    let src_state = src.send("tick");

    // Spares: forks made ahead of time, held frozen; a fork of the statepoint takes one (a rename
    // and a thaw). Asked again for as many, nothing new is made.
    let spares = spare(&src, &sp, 3);
    let _c: Vec<Cleanup> = spares.iter().cloned().map(Cleanup).collect();
    assert_eq!(spares, (1..=3).map(|k| format!("{}-spare-{sp}-{k}", src.name)).collect::<Vec<_>>());
    for s in &spares {
        assert!(held_frozen(s), "{s}");
    }
    assert_eq!(spare(&src, &sp, 3), spares);
    let (mut a, how_a) = fork(&src, &sp, "fa");
    let (mut b, how_b) = fork(&src, &sp, "fb");
    assert_eq!((how_a.as_deref(), how_b.as_deref()), (Some("spare"), Some("spare")));
    assert!(
        status(&spares[0]).code != Some(0) && status(&spares[1]).code != Some(0),
        "handed out under their new names"
    );
    assert!(held_frozen(&spares[2]));
    // Without a name, a fork takes the spare left under its own name (a thaw, no rename).
    let r = cmd(planarian_bin().to_str().unwrap(), ["fork", &src.name, &sp, "--json"]);
    r.ok();
    let ctx: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        (ctx["container"].as_str(), ctx["how"]["path"].as_str()),
        (Some(spares[2].as_str()), Some("spare")),
        "{ctx}"
    );
    assert!(status(&spares[2]).out() == "running" && !held_frozen(&spares[2]));
    assert_eq!(Sandbox::attach(&spares[2]).state(), at_sp, "the spare kept under its name starts at the statepoint");
    assert!(registered_spares(&src, &sp).is_empty(), "no spare left registered");
    let ps = podman("planarian", &["ps", "--format", "{{.Names}}"]).stdout;
    assert!(ps.contains(&a.name) && ps.contains(&b.name) && ps.contains(&src.name), "{ps}");
    for f in [&mut a, &mut b] {
        assert_own_bundle(f, &src);
        assert_eq!(f.state(), at_sp, "{} starts at the statepoint", f.name);
        let now = f.send("tick");
        assert_eq!((now.counter, &now.checksum), (at_sp.counter + 1, &at_sp.checksum), "{}", f.name);
        assert_eq!(f.sh("cat /root/f").stdout, "base\n", "{}", f.name);
    }

    // They diverge; each takes an incremental statepoint of its own and rolls back to it.
    a.sh("echo a > /root/f").ok();
    let sa = a.send("dirty 1048576 65536");
    b.sh("echo b > /root/f").ok();
    let sb_ = b.send("dirty 8388608 65536");
    assert_ne!(sa.checksum, sb_.checksum);
    let spa = a.snapshot("a1");
    let spb = b.snapshot("b1");
    a.assert_incremental(&spa, 1, 2_048);
    b.assert_incremental(&spb, 1, 2_048);
    for (f, spx, st, file) in [(&mut a, &spa, &sa, "a\n"), (&mut b, &spb, &sb_, "b\n")] {
        f.send("dirty 0 1000000");
        f.sh("echo junk > /root/f").ok();
        f.rollback(spx);
        assert_eq!(f.send("tick").checksum, st.checksum, "{} after rollback", f.name);
        assert_eq!(f.sh("cat /root/f").stdout, file, "{} after rollback", f.name);
    }
    // A fork's statepoint list is its own; the fork point is its first statepoint.
    assert_eq!(a.statepoints().len(), 2);

    // The source never noticed.
    assert_eq!(src.send("tick").checksum, src_state.checksum);
    assert_eq!(src.sh("cat /root/f").stdout, "src\n");

    // `--count 0` removes a statepoint's spares; removing the statepoint removes them too.
    let gone = spare(&src, &sp, 1);
    let _c0 = Cleanup(gone[0].clone());
    assert_eq!(spare(&src, &sp, 0), Vec::<String>::new());
    assert_ne!(status(&gone[0]).code, Some(0), "--count 0 removed the spare");
    let last = spare(&src, &sp, 1);
    let _c1 = Cleanup(last[0].clone());
    assert!(held_frozen(&last[0]));
    let notes = cmd(planarian_bin().to_str().unwrap(), ["statepoint", "show", &src.name, &sp]).ok().out();
    assert!(
        notes.contains(&format!("forked into {}", a.name)) && notes.contains(&format!("forked into {}", b.name)),
        "{notes}"
    );
    planarian(&["statepoint", "rm", &src.name, &sp]).ok();
    assert_ne!(status(&last[0]).code, Some(0), "statepoint rm removed its spare");

    // Removing the source breaks nothing: a fork's chain is its own.
    podman("planarian", &["rm", "-f", "-t", "0", &src.name]).ok();
    a.send("dirty 0 4096");
    a.rollback(a.statepoints()[0]["statepoint-id"].as_str().unwrap());
    let back = a.send("tick");
    assert_eq!(back.checksum, at_sp.checksum);
    assert_eq!(a.sh("cat /root/f").stdout, "base\n");
    podman("planarian", &["stop", "-t", "0", &b.name]).ok();
}

/// `planarian fork --count N`: N forks in one call, the spares of the statepoint taken first and
/// the rest made side by side under names of their own; each starts exactly at the statepoint
/// and snapshots incrementally. Names given twice, or not one per fork, are refused with one line
/// before anything is made.
#[test]
fn n_forks_in_one_call_take_the_spares_and_make_the_rest_side_by_side() {
    require_stack!();
    // (memory on demand at any size: the forks made side by side restore lazily)
    let mut src = Sandbox::start("fcount", 16, &["--annotation", "io.planarian.checkpoint.lazy_pages_min_mib=0"]);
    src.sh("echo base > /root/f").ok();
    let at_sp = src.send("tick");
    let sp = src.snapshot("fork-point");
    src.send("dirty 0 65536");
    let spares = spare(&src, &sp, 1);
    let pl = planarian_bin();
    let pl = pl.to_str().unwrap();
    let stem = format!("{}-fork-{sp}", src.name);
    let made: Vec<String> = (1..=2).map(|k| format!("{stem}-{k}")).collect();
    let _c: Vec<Cleanup> = spares.iter().chain(&made).cloned().map(Cleanup).collect();

    for (args, says) in [
        (vec!["--count", "2", "--name", "x", "--name", "x"], "two forks cannot both be named x"),
        (vec!["--count", "2", "--name", "x"], "give one name per fork"),
        (vec!["--count", "0"], "--count"),
    ] {
        let r = cmd(pl, ["fork", &src.name, &sp].into_iter().chain(args.iter().copied()));
        assert!(r.code != Some(0) && r.stderr.contains(says), "{args:?}: {r:?}");
        assert_ne!(podman("planarian", &["container", "exists", "x"]).code, Some(0), "{args:?}");
    }
    assert!(held_frozen(&spares[0]), "a refused call claims no spare");

    let r = cmd(pl, ["fork", &src.name, &sp, "--count", "3", "--json"]);
    r.ok();
    assert!(r.stderr.contains("3 time(s)") && r.stderr.contains("total"), "{}", r.stderr);
    // (the two made here have the source's config made theirs: no podman container init)
    assert_eq!(r.stderr.matches("the source's, made the fork's").count(), 2, "{}", r.stderr);
    let forks: Vec<serde_json::Value> = serde_json::from_str(&r.stdout).unwrap();
    let names: Vec<&str> = forks.iter().map(|f| f["container"].as_str().unwrap()).collect();
    assert_eq!(names, [spares[0].as_str(), made[0].as_str(), made[1].as_str()], "{}", r.stdout);
    let paths: Vec<Option<&str>> = forks.iter().map(|f| f["how"]["path"].as_str()).collect();
    assert_eq!(paths, [Some("spare"), None, None]);
    for n in &names {
        let mut f = Sandbox::attach(n);
        let bundle = assert_own_bundle(&mut f, &src);
        assert_eq!(f.state(), at_sp, "{n} starts at the statepoint");
        assert_eq!(f.sh("cat /root/f").stdout, "base\n", "{n}");
        f.send("dirty 1048576 65536");
        let first = f.snapshot("first");
        f.assert_incremental(&first, 1, 2_048);
        // Its page server served it (the snapshot waited for it to end).
        let log = std::fs::read_to_string(bundle.join("planarian-restore/lazy-pages.log"));
        assert!(log.as_deref().is_ok_and(|l| l.contains("lazy_pages")), "{n}: restored on demand: {log:?}");
    }
    assert_eq!(src.statepoints().len(), 1, "the source is untouched");
}

#[test]
fn fork_of_an_unknown_statepoint_creates_nothing() {
    require_stack!();
    let src = Sandbox::start("fbad", 8, &[]);
    let new = name("fnot");
    let r = cmd(planarian_bin().to_str().unwrap(), ["fork", &src.name, "sp999", "--name", &new]);
    assert!(r.code != Some(0) && r.stderr.contains("unknown statepoint sp999"), "{r:?}");
    assert_ne!(podman("planarian", &["container", "exists", &new]).code, Some(0));
}

/// A fork runs beside the source's tool calls: it holds the source's lock shared, so a tool call
/// in flight (here a holder of the shared lock that never ends on its own) does not stop it,
/// while a rollback of the source, which needs the lock exclusive, waits for that tool call.
/// (The source has a named volume: its fork's config is Podman's, `podman container init`.)
#[test]
fn a_fork_runs_beside_a_tool_call_on_the_source() {
    require_stack!();
    let volume = name("fvol");
    struct Volume(String);
    impl Drop for Volume {
        fn drop(&mut self) {
            let _ = podman("planarian", &["volume", "rm", "-f", &self.0]);
        }
    }
    let _v = Volume(volume.clone());
    let src = Sandbox::start("fbeside", 8, &["-v", &format!("{volume}:/data")]);
    src.sh("echo kept > /data/v").ok();
    let sp = src.snapshot("fork-point");
    let id = src.id();
    let lock = format!("/var/lib/planarian/containers/{id}/lock");
    let mut tool_call = std::process::Command::new("flock").args(["-s", &lock, "sleep", "100000"]).spawn().unwrap();
    // flock has the lock once a non-blocking exclusive attempt fails.
    assert!(wait_for(std::time::Duration::from_secs(60), || cmd("flock", ["-n", "-x", &lock, "true"]).code != Some(0)));
    let new = name("fbeside-new");
    let _c = Cleanup(new.clone());
    let pl = planarian_bin();
    // Bounded, so that a fork that waits for the tool call fails the test instead of hanging it.
    let r = cmd("timeout", ["600", pl.to_str().unwrap(), "fork", &src.name, &sp, "--name", &new]);
    // A rollback does wait for it: it is seen waiting for the lock, then stopped.
    let mut rollback = std::process::Command::new(pl)
        .args(["rollback", &src.name, &sp])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let waited = wait_for(std::time::Duration::from_secs(120), || {
        lock_waited_for(std::path::Path::new(&lock)) || rollback.try_wait().unwrap().is_some()
    });
    let running = rollback.try_wait().unwrap().is_none();
    let _ = rollback.kill();
    let _ = rollback.wait();
    let _ = tool_call.kill();
    let _ = tool_call.wait();
    r.ok();
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &new]).out(), "running");
    assert!(waited && running, "the rollback did not wait for the tool call");
    assert!(r.stderr.contains("podman container init (its mount of /data is a volume)"), "{}", r.stderr);
    let fork = Sandbox::attach(&new);
    assert_eq!(fork.sh("cat /data/v").ok().stdout, "kept\n", "the volume is the source's, shared");
    // (the containers go before their volume)
    drop((fork, _c, src));
}
