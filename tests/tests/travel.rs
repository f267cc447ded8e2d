//! Statepoints that leave the machine: Podman's `checkpoint --export` and `restore --import`
//! across a lost store (files on the copy path and on ZFS), with `--import --name` as a second
//! copy; CRI-O's exact call sequence replayed through the real conmon; statepoints moved
//! between two pools with `planarian statepoint export/import`.

use planarian_system_tests::sandbox::{Sandbox, State};
use planarian_system_tests::*;
use std::path::{Path, PathBuf};

/// What an agent changed in the files: names and contents.
const LISTING: &str = "find /work /etc/motd /etc/debian_version 2>/dev/null | sort; cat /work/* /etc/motd 2>&1";

fn id_of(name: &str) -> String {
    podman("planarian", &["inspect", "--format", "{{.Id}}", name]).ok().out()
}

fn store_of(id: &str) -> PathBuf {
    Path::new("/var/lib/planarian/containers").join(id)
}

/// Checkpoints `sb` into `archive` with Podman's `--export`, removes the container and wipes its
/// part of planarian's store, as if the archive had gone to another machine. Returns the ID and
/// the seconds the checkpoint took.
fn export_and_lose(sb: &Sandbox, archive: &str) -> (String, f64) {
    let id = sb.id();
    let _ = std::fs::remove_file(archive);
    let t = std::time::Instant::now();
    podman("planarian", &["container", "checkpoint", &format!("--export={archive}"), &sb.name]).ok();
    let secs = t.elapsed().as_secs_f64();
    let size = std::fs::metadata(archive).expect("the archive was written").len();
    println!("{}: the export archive is {size} bytes", sb.name);
    podman("planarian", &["rm", "-f", "-t", "0", &sb.name]).ok();
    assert!(store_of(&id).is_dir(), "planarian kept no store for {id}");
    std::fs::remove_dir_all(store_of(&id)).unwrap();
    (id, secs)
}

/// The tick after a restore continues from `at`: same memory, counter one on.
fn assert_continues(sb: &mut Sandbox, at: &State) {
    let now = sb.send("tick");
    assert_eq!(
        (now.counter, &now.checksum),
        (at.counter + 1, &at.checksum),
        "{}: memory and counter continue from the checkpoint",
        sb.name
    );
}

/// The one statepoint an import made, checked to say where it came from.
fn imported_statepoint(sb: &Sandbox, from_id: &str) -> String {
    let sps = sb.statepoints();
    assert_eq!(sps.len(), 1, "{sps:?}");
    let from = sps[0]["imported-from"].as_str().unwrap_or_default().to_string();
    assert!(from.starts_with(&from_id[..12]), "imported-from {from:?} should name {from_id}");
    sps[0]["statepoint-id"].as_str().unwrap().to_string()
}

#[test]
fn podman_export_import_restores_across_a_lost_store_and_starts_a_chain() {
    require_stack!();
    let mut sb = Sandbox::start("travel", 16, &[]);
    sb.send("tick");
    sb.send("dirty 65536 262144");
    sb.sh("mkdir -p /work && echo v1 > /work/notes && echo changed > /etc/motd").ok();
    // A statepoint first: the exported checkpoint is an incremental dump on top of it, so the
    // archive must carry the chain, not just the newest level.
    sb.snapshot("base");
    sb.send("dirty 1048576 131072");
    let at = sb.send("tick");
    sb.sh("echo v2 >> /work/notes; rm /etc/debian_version; echo new > /work/new").ok();
    let files = sb.sh(LISTING).ok().out();
    let archive = "/tmp/planarian-travel.tar.gz";
    let (id, _) = export_and_lose(&sb, archive);

    podman("planarian", &["container", "restore", &format!("--import={archive}")]).ok();
    let mut back = Sandbox::attach(&sb.name);
    assert_eq!(id_of(&back.name), id);
    assert_continues(&mut back, &at);
    assert_eq!(back.sh(LISTING).ok().out(), files, "files after the import");
    let sp = imported_statepoint(&back, &id);
    assert_eq!(back.chain(&sp)["depth"], 1, "the imported statepoint keeps its place in its chain");

    // The images are the start of a chain here: the next dump is incremental against them.
    back.send("dirty 0 65536");
    let next = back.snapshot("after-import");
    back.assert_incremental(&next, 2, 1000);
    // And the imported statepoint is one like any other: rollback returns to it exactly.
    back.sh("echo later > /work/later").ok();
    back.rollback(&sp);
    assert_continues(&mut back, &at);
    assert_eq!(back.sh(LISTING).ok().out(), files, "files after a rollback to the imported statepoint");

    // Podman's own fork: a second container from the same archive, a store of its own.
    let copy = format!("{}-copy", sb.name);
    podman("planarian", &["container", "restore", &format!("--import={archive}"), "--name", &copy]).ok();
    let mut second = Sandbox::attach(&copy);
    assert_continues(&mut second, &at);
    assert_eq!(second.sh(LISTING).ok().out(), files);
    imported_statepoint(&second, &id);
    // The two are independent.
    second.sh("echo only-in-copy > /work/notes").ok();
    assert_eq!(back.sh("cat /work/notes").ok().out(), "v1\nv2");
}

// ---------------------------------------------------------------------------------------------
// CRI-O's calls, replayed

/// The runtime as CRI-O's handler runs it: a wrapper that logs each argv, then execs planarian.
struct Handler {
    path: PathBuf,
    log: PathBuf,
}

/// The runtime root CRI-O's handler is configured with (`runtime_root`).
const CRIO_ROOT: &str = "/run/planarian-crio";

impl Handler {
    fn new(dir: &Path) -> Handler {
        let (path, log) = (dir.join("planarian-handler"), dir.join("argv.log"));
        let script = format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" >> {}\nexec {} \"$@\"\n",
            log.display(),
            planarian_bin().display()
        );
        write_executable(&path, &script);
        Handler { path, log }
    }

    /// A verb CRI-O calls directly: `RUNTIME --root ROOT VERB…`.
    fn call(&self, args: &[&str]) -> Run {
        let mut all = vec!["--root", CRIO_ROOT];
        all.extend_from_slice(args);
        cmd(self.path.to_str().unwrap(), all)
    }

    /// What to read when a step fails: every argv, conmon's and planarian's logs.
    fn diagnose(&self, c: &CrioContainer) -> String {
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| format!("({}: {e})", p.display()));
        let log = read(Path::new("/var/log/planarian.log"));
        let tail: Vec<&str> = log.lines().rev().take(15).collect();
        format!(
            "state: {:?}\nargv:\n{}\ncontainer log:\n{}\nplanarian.log (newest first):\n{}",
            self.call(&["state", &c.id]),
            read(&self.log),
            read(&c.dir.join("ctr.log")),
            tail.join("\n")
        )
    }

    fn state(&self, id: &str) -> String {
        let r = self.call(&["state", id]);
        serde_json::from_str::<serde_json::Value>(&r.stdout)
            .ok()
            .and_then(|v| v["status"].as_str().map(String::from))
            .unwrap_or_default()
    }
}

/// A container's directory as CRI-O lays it out (`bundlePath` = `Dir()`), its rootfs an overlay
/// on the image, as containers/storage mounts it.
struct CrioContainer {
    id: String,
    dir: PathBuf,
    rootfs: PathBuf,
}

impl CrioContainer {
    fn new(base: &Path, id: &str, image: &str) -> CrioContainer {
        let dir = base.join(id);
        for d in ["upper", "work", "rootfs"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let rootfs = dir.join("rootfs");
        let opts = format!("lowerdir={image},upperdir={0}/upper,workdir={0}/work", dir.display());
        cmd("mount", ["-t", "overlay", "overlay", "-o", &opts, rootfs.to_str().unwrap()]).ok();
        CrioContainer { id: id.to_string(), dir, rootfs }
    }

    /// The OCI config CRI-O writes: the workload, the pod's network namespace, a cgroup.
    fn write_spec(&self, spec: &serde_json::Value) {
        std::fs::write(self.dir.join("config.json"), serde_json::to_vec_pretty(spec).unwrap()).unwrap();
    }

    /// conmon as CRI-O starts it (`internal/oci/runtime_oci.go` CreateContainer), with
    /// `--restore DIR` for a restore.
    fn conmon(&self, handler: &Handler, restore: Option<&Path>) {
        let d = self.dir.display().to_string();
        // CRI-O's ContainerAttachSocketDir (conmon links `<dir>/<id>` to the bundle).
        let sockets = self.dir.parent().unwrap().join("sockets").display().to_string();
        std::fs::create_dir_all(&sockets).unwrap();
        let mut args: Vec<String> = [
            "-b",
            &d,
            "-c",
            &self.id,
            "--exit-dir",
            &format!("{d}/exits"),
            "-l",
            &format!("{d}/ctr.log"),
            "--log-level",
            "info",
            "-n",
            &format!("k8s_{}", self.id),
            "-P",
            &format!("{d}/conmon-pidfile"),
            "-p",
            &format!("{d}/pidfile"),
            "--persist-dir",
            &d,
            "-r",
            handler.path.to_str().unwrap(),
            "--runtime-arg",
            &format!("--root={CRIO_ROOT}"),
            "--socket-dir-path",
            &sockets,
            "--syslog",
            "-u",
            &self.id,
            "--log-size-max",
            "-1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        std::fs::create_dir_all(self.dir.join("exits")).unwrap();
        if let Some(r) = restore {
            args.extend(["--restore".to_string(), r.display().to_string()]);
        }
        let out = std::process::Command::new("conmon")
            .args(&args)
            .current_dir(&self.dir)
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .output()
            .unwrap();
        assert!(out.status.success(), "conmon {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn file(&self, p: &str) -> Option<String> {
        std::fs::read_to_string(self.rootfs.join(p)).ok()
    }

    /// Sends the workload a command through its files (CRI-O's exec is conmon's; not what this
    /// test is about) and waits for its answer.
    fn send(&self, seq: u64, cmd_: &str) -> State {
        let tmp = self.rootfs.join("tmp/.cmd-host");
        std::fs::write(&tmp, format!("{seq} {cmd_}\n")).unwrap();
        std::fs::rename(&tmp, self.rootfs.join("tmp/cmd")).unwrap();
        let mut last = None;
        assert!(
            wait_for(std::time::Duration::from_secs(60), || {
                last = self.file("tmp/state");
                last.as_deref().and_then(|s| s.split_whitespace().next()) == Some(&seq.to_string())
            }),
            "{}: command {cmd_} not acknowledged: {last:?}",
            self.id
        );
        let text = last.unwrap();
        let f: Vec<&str> = text.split_whitespace().collect();
        State { counter: f[1].parse().unwrap(), checksum: f[2].to_string() }
    }

    fn remove(&self, handler: &Handler) {
        handler.call(&["kill", &self.id, "9"]);
        wait_for(std::time::Duration::from_secs(30), || handler.state(&self.id) != "running");
        handler.call(&["delete", "--force", &self.id]);
        cmd("umount", ["-l", self.rootfs.to_str().unwrap()]);
    }
}

/// A container ID as CRI-O makes them (64 hex digits), distinct in its first 12.
fn crio_id(tag: u8) -> String {
    format!("{tag:02x}{:08x}{}", std::process::id(), "0".repeat(54))
}

/// Network namespaces standing in for two pods; removed when dropped.
struct Pods(Vec<String>);

impl Drop for Pods {
    fn drop(&mut self) {
        for p in &self.0 {
            cmd("ip", ["netns", "del", p]);
        }
    }
}

#[test]
fn crio_call_sequence_replayed_through_conmon_restores_in_another_pod() {
    require_stack!();
    // (readable by all, as a directory of /tmp would be: the runtimes and the containers' users
    // go through it)
    let scratch = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let base = scratch.path().to_path_buf();
    let handler = Handler::new(&base);
    let pods =
        Pods(vec![format!("planarian-poda-{}", std::process::id()), format!("planarian-podb-{}", std::process::id())]);
    for p in &pods.0 {
        cmd("ip", ["netns", "add", p]).ok();
        // As a pod's network namespace: its loopback up (CRIU's checks connect inside it).
        cmd("ip", ["netns", "exec", p, "ip", "link", "set", "lo", "up"]).ok();
    }
    let image = podman("planarian", &["image", "mount", DEBIAN]).ok().out();
    // Remote state: a hook that says where the sandbox's MCP calls are (position 42), so the
    // checkpoint records a position that must travel with it.
    let hook = base.join("remote-hook");
    let body = "#!/bin/sh\ncase $1 in capture) echo '{\"external-endpoint\": \"db://agents\", \"mcp-call-position\": 42}';; esac\n";
    write_executable(&hook, body);
    let _hooks = DropIn::new("zz-crio-remote-hook", &format!("[hooks]\nremote = [\"{}\"]\n", hook.display()));

    // Discovery: what CRI-O runs at start and before checkpoint/restore.
    assert!(handler.call(&["--version"]).ok().stdout.contains("version"));
    let features = handler.call(&["features"]);
    println!("features: exit {:?}", features.code);
    handler.call(&["checkpoint", "--help"]).ok();

    // create through conmon, start directly.
    let a = CrioContainer::new(&base, &crio_id(0xa), &image);
    cmd("sh", ["-c", &format!("cd {} && rm -f config.json && crun spec", a.dir.display())]).ok();
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(a.dir.join("config.json")).unwrap()).unwrap();
    spec["root"] = serde_json::json!({ "path": a.rootfs, "readonly": false });
    spec["process"]["terminal"] = false.into();
    spec["process"]["args"] = serde_json::json!(["python3", "-c", planarian_system_tests::sandbox::WORKLOAD, "8"]);
    spec["process"]["env"] = serde_json::json!(["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]);
    spec["hostname"] = "crio-pod".into();
    spec["linux"]["cgroupsPath"] = format!("/planarian-crio/{}", a.id).into();
    let netns = |pod: &str| serde_json::json!({ "type": "network", "path": format!("/var/run/netns/{pod}") });
    let set_netns = |spec: &mut serde_json::Value, pod: &str| {
        let ns = spec["linux"]["namespaces"].as_array_mut().unwrap();
        ns.retain(|n| n["type"] != "network");
        ns.push(netns(pod));
    };
    set_netns(&mut spec, &pods.0[0]);
    a.write_spec(&spec);
    a.conmon(&handler, None);
    assert!(
        wait_for(std::time::Duration::from_secs(60), || handler.state(&a.id) == "created"),
        "{}",
        handler.diagnose(&a)
    );
    handler.call(&["start", &a.id]).ok();
    assert!(
        wait_for(std::time::Duration::from_secs(60), || a.file("tmp/state").is_some()),
        "the workload did not start: {}",
        handler.diagnose(&a)
    );
    a.send(1, "tick");
    let at = a.send(2, "dirty 65536 131072");
    std::fs::create_dir_all(a.rootfs.join("work")).unwrap();
    std::fs::write(a.rootfs.join("work/notes"), "from pod a\n").unwrap();

    // kubelet's checkpoint: pause, checkpoint directly with CRI-O's flags, resume.
    let ckpt = a.dir.join("checkpoint");
    std::fs::write(a.dir.join("dump.log"), "").unwrap();
    handler.call(&["pause", &a.id]).ok();
    handler
        .call(&[
            "checkpoint",
            "--file-locks",
            "--image-path",
            ckpt.to_str().unwrap(),
            "--work-path",
            a.dir.to_str().unwrap(),
            "--leave-running",
            &a.id,
        ])
        .ok();
    handler.call(&["resume", &a.id]).ok();
    assert_eq!(handler.state(&a.id), "running");
    // The source keeps running after the checkpoint.
    assert_eq!(a.send(3, "tick").counter, at.counter + 1);

    // The archive with CRI-O's names; checkpoint/ deleted as CRI-O does.
    std::fs::write(a.dir.join("spec.dump"), serde_json::to_vec(&spec).unwrap()).unwrap();
    std::fs::write(
        a.dir.join("config.dump"),
        serde_json::json!({ "id": a.id, "name": "agent", "rootfsImageName": DEBIAN }).to_string(),
    )
    .unwrap();
    std::fs::write(a.dir.join("bind.mounts"), "[]").unwrap();
    cmd(
        "tar",
        ["-C", a.dir.join("upper").to_str().unwrap(), "-cf", a.dir.join("rootfs-diff.tar").to_str().unwrap(), "."],
    )
    .ok();
    let archive = base.join("checkpoint-pod-agent.tar");
    cmd(
        "tar",
        [
            "-C",
            a.dir.to_str().unwrap(),
            "-cf",
            archive.to_str().unwrap(),
            "checkpoint",
            "config.dump",
            "spec.dump",
            "stats-dump",
            "dump.log",
            "bind.mounts",
            "rootfs-diff.tar",
        ],
    )
    .ok();
    let handed_manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(ckpt.join("planarian/manifest.json")).expect("the checkpoint carries planarian's manifest"),
    )
    .unwrap();
    std::fs::remove_dir_all(&ckpt).unwrap();
    println!("CRI-O archive: {} bytes", std::fs::metadata(&archive).unwrap().len());
    a.remove(&handler);
    // As on another node: nothing of the source's store is left.
    std::fs::remove_dir_all(store_of(&a.id)).unwrap();

    // Restore as CRI-O does: a new container in another pod, the files diff applied by CRI-O,
    // the checkpoint unpacked, conmon --restore.
    let b = CrioContainer::new(&base, &crio_id(0xb), &image);
    let unpacked = b.dir.join("unpacked");
    std::fs::create_dir_all(&unpacked).unwrap();
    cmd("tar", ["-C", unpacked.to_str().unwrap(), "-xf", archive.to_str().unwrap()]).ok();
    cmd("tar", ["-C", b.rootfs.to_str().unwrap(), "-xf", unpacked.join("rootfs-diff.tar").to_str().unwrap()]).ok();
    std::fs::rename(unpacked.join("checkpoint"), b.dir.join("checkpoint")).unwrap();
    assert!(b.dir.join("checkpoint/inventory.img").is_file());
    let mut spec_b: serde_json::Value =
        serde_json::from_slice(&std::fs::read(unpacked.join("spec.dump")).unwrap()).unwrap();
    spec_b["root"]["path"] = b.rootfs.display().to_string().into();
    spec_b["linux"]["cgroupsPath"] = format!("/planarian-crio/{}", b.id).into();
    set_netns(&mut spec_b, &pods.0[1]);
    b.write_spec(&spec_b);
    b.conmon(&handler, Some(&b.dir.join("checkpoint")));
    assert!(
        wait_for(std::time::Duration::from_secs(60), || handler.state(&b.id) == "running"),
        "{}",
        handler.diagnose(&b)
    );

    // Processes: memory and counter as at the checkpoint, in pod b's network namespace.
    let now = b.send(4, "tick");
    assert_eq!((now.counter, &now.checksum), (at.counter + 1, &at.checksum));
    let pid = std::fs::read_to_string(b.dir.join("pidfile")).unwrap().trim().to_string();
    let ns_of = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
    assert_eq!(
        ns_of(&format!("/proc/{pid}/ns/net")),
        ns_of(&format!("/var/run/netns/{}", pods.0[1])),
        "restored into pod b's network"
    );
    // Files.
    assert_eq!(b.file("work/notes").as_deref(), Some("from pod a\n"));
    // The statepoint came with it, MCP position included, and starts b's chain.
    let imported: serde_json::Value =
        serde_json::from_str(&planarian(&["statepoint", "list", &b.id, "--json"]).ok().stdout).unwrap();
    let sp = &imported.as_array().unwrap()[0];
    assert_eq!(handed_manifest["remote-state"][0]["mcp-call-position"], 42, "{handed_manifest}");
    assert_eq!(sp["remote-state"], handed_manifest["remote-state"]);
    assert_eq!(sp["options"]["file-locks"], true, "the dump's options travel with it");
    assert!(sp["imported-from"].as_str().unwrap().starts_with(&a.id[..12]));
    b.remove(&handler);
    podman("planarian", &["image", "unmount", DEBIAN]);

    let argv = std::fs::read_to_string(&handler.log).unwrap();
    let mut shown: Vec<&str> = argv.lines().collect();
    shown.dedup();
    println!("argv the runtime received (repeats folded):\n{}", shown.join("\n"));
    assert!(
        argv.lines().any(|l| l.starts_with(&format!("--root={CRIO_ROOT} create "))
            || l.starts_with(&format!("--root={CRIO_ROOT} --"))
            || l.contains(" create ")),
        "{argv}"
    );
    assert!(argv.lines().any(|l| l.contains(" restore ") && l.contains("--image-path")), "{argv}");
}

// ---------------------------------------------------------------------------------------------
// planarian statepoint export / import

/// A second ZFS pool on a file, as another machine's; destroyed when dropped.
struct Pool(String);

impl Pool {
    fn new(name: &str) -> Pool {
        let img = format!("/var/tmp/{name}.img");
        cmd("truncate", ["-s", "1G", &img]).ok();
        cmd("zpool", ["create", "-m", &format!("/{name}"), name, &img]).ok();
        cmd("zfs", ["create", &format!("{name}/sb")]).ok();
        Pool(name.to_string())
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        cmd("zpool", ["destroy", "-f", &self.0]);
        let _ = std::fs::remove_file(format!("/var/tmp/{}.img", self.0));
    }
}

fn size(p: &str) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

#[test]
fn statepoints_move_between_pools_and_podman_export_carries_zfs_files() {
    require_stack!();
    let Some(pool) = zfs_test_pool() else { return };
    let parent = zfs_parent(&pool);
    let other = Pool::new(&format!("pltestb{}", std::process::id()));
    let ann = format!("io.planarian.zfs.parent_dataset={parent}");
    let mut sb = Sandbox::start("move", 8, &["--annotation", &ann]);
    sb.sh("mkdir -p /work && echo v1 > /work/notes").ok();
    let at1 = sb.send("dirty 4096 65536");
    let files1 = sb.sh(LISTING).ok().out();
    let sp1 = sb.snapshot("one");
    sb.sh("echo v2 >> /work/notes; rm /etc/debian_version").ok();
    let at2 = sb.send("dirty 1048576 65536");
    let files2 = sb.sh(LISTING).ok().out();
    let sp2 = sb.snapshot("two");

    let timed = |args: &[&str]| {
        let t = std::time::Instant::now();
        let r = planarian(args);
        r.ok();
        println!("{}", r.out());
        t.elapsed().as_secs_f64()
    };
    let (f1, f2, f2_inc, podman_file) = (
        "/tmp/planarian-sp1.tar",
        "/tmp/planarian-sp2.tar",
        "/tmp/planarian-sp2-inc.tar",
        "/tmp/planarian-podman.tar.gz",
    );
    let t1 = timed(&["statepoint", "export", &sb.name, &sp1, f1]);
    let t2 = timed(&["statepoint", "export", &sb.name, &sp2, f2]);
    let t2_inc = timed(&["statepoint", "export", &sb.name, &sp2, f2_inc, "--since", &sp1]);
    assert!(
        size(f2_inc) < size(f2),
        "the incremental file ({}) should be smaller than the whole one ({})",
        size(f2_inc),
        size(f2)
    );

    // On the other pool: sp1 as a new container, then sp2 as another, its files only the changes.
    let b1 = format!("{}-b1", sb.name);
    planarian(&["statepoint", "import", f1, "--name", &b1, "--parent-dataset", &format!("{}/sb", other.0)]).ok();
    let mut s1 = Sandbox::attach(&b1);
    assert_continues(&mut s1, &at1);
    assert_eq!(s1.sh(LISTING).ok().out(), files1);
    let b1_id = id_of(&b1);
    assert_eq!(
        cmd("zfs", ["get", "-H", "-o", "value", "mounted", &format!("{}/sb/ctr-{b1_id}", other.0)]).ok().out(),
        "yes",
        "b1 lives on the other pool"
    );
    let b2 = format!("{}-b2", sb.name);
    planarian(&["statepoint", "import", f2_inc, "--name", &b2, "--parent-dataset", &format!("{}/sb", other.0)]).ok();
    let mut s2 = Sandbox::attach(&b2);
    assert_continues(&mut s2, &at2);
    assert_eq!(s2.sh(LISTING).ok().out(), files2);
    // b2's files are b1's snapshot plus the changes: a clone of it, as a fork is.
    let b2_ds = format!("{}/sb/ctr-{}", other.0, id_of(&b2));
    let origin = cmd("zfs", ["get", "-H", "-o", "value", "origin", &b2_ds]).ok().out();
    assert!(
        origin.starts_with(&format!("{}/sb/ctr-{b1_id}@", other.0)),
        "b2's files are b1's plus the changes: origin {origin}"
    );
    // While b2 runs on that clone, a rollback of b1 that stops and restores swaps b1's dataset
    // (`zfs rename`). zfs-fuse remounts the clone for that and cannot while b2 uses it: refused
    // before anything changes, b1 runs on as it was. OpenZFS leaves the clone where it is: b1
    // goes back, b2 runs on untouched. (In place nothing is swapped: tested in datasets.)
    let b1_sp = imported_statepoint(&s1, &sb.id());
    s1.sh("echo later > /work/later").ok();
    let stop_and_restore = {
        let _off = DropIn::new("in-place-off", "[checkpoint]\nrollback_in_place = false\n");
        planarian(&["rollback", &b1, &b1_sp])
    };
    if cmd("zfs", ["version"]).code == Some(0) {
        stop_and_restore.ok();
        s1.seq = s1.read().expect("b1 runs").0;
        assert_continues(&mut s1, &at1);
        assert_eq!(s1.sh(LISTING).ok().out(), files1, "b1's files at its statepoint");
        assert_eq!(s2.sh(LISTING).ok().out(), files2, "b2's files untouched");
        assert_eq!(cmd("zfs", ["get", "-H", "-o", "value", "mounted", &b2_ds]).ok().out(), "yes");
    } else {
        let refused = stop_and_restore;
        assert_ne!(refused.code, Some(0), "{refused:?}");
        assert!(
            refused.stderr.contains("run on clones of its snapshots") && refused.stderr.contains(&b2_ds),
            "{}",
            refused.stderr
        );
        assert_eq!(s1.sh("cat /work/later").ok().out(), "later");
        assert_eq!(s1.send("tick").counter, at1.counter + 2);
    }
    imported_statepoint(&s2, &sb.id());

    // Podman's own export of the same sandbox, files on ZFS: the container removed, its store and
    // dataset gone (as on another machine), `restore --import` brings it back from the archive.
    let (id, tp) = export_and_lose(&sb, podman_file);
    // Another machine has none of its datasets either. (Removing the container removes it in the
    // background, which the wiped store may have cut short: destroyed here, retried while that
    // removal may still be at it.)
    let dataset = format!("{parent}/ctr-{id}");
    let gone = wait_for(std::time::Duration::from_secs(120), || {
        cmd("zfs", ["list", "-H", &dataset]).code != Some(0) || cmd("zfs", ["destroy", "-r", &dataset]).code == Some(0)
    });
    assert!(gone, "{dataset} cannot be destroyed");
    podman("planarian", &["container", "restore", &format!("--import={podman_file}")]).ok();
    let mut back = Sandbox::attach(&sb.name);
    assert_continues(&mut back, &at2);
    assert_eq!(back.sh(LISTING).ok().out(), files2, "files after the import");
    // The files came as a ZFS stream: the container runs on a dataset again, with the imported
    // statepoint as its snapshot.
    let sp = imported_statepoint(&back, &id);
    assert_eq!(cmd("zfs", ["get", "-H", "-o", "value", "mounted", &dataset]).ok().out(), "yes");
    let snap = back.manifest(&sp)["local-state"]["zfs-snapshot"].as_str().unwrap().to_string();
    assert_eq!(snap, format!("{dataset}@planarian-{}-{sp}", &id[..12]));
    back.sh("echo from-the-dataset > /work/probe").ok();
    let mp = cmd("zfs", ["get", "-H", "-o", "value", "mountpoint", &dataset]).ok().out();
    assert_eq!(std::fs::read_to_string(Path::new(&mp).join("work/probe")).unwrap(), "from-the-dataset\n");

    println!("| export | bytes | seconds |\n|---|---:|---:|");
    for (what, file, secs) in [
        ("statepoint export sp1 (whole)", f1, t1),
        ("statepoint export sp2 (whole)", f2, t2),
        ("statepoint export sp2 --since sp1", f2_inc, t2_inc),
        ("podman container checkpoint --export (zstd)", podman_file, tp),
    ] {
        println!("| {what} | {} | {secs:.1} |", size(file));
    }
    for f in [f1, f2, f2_inc, podman_file] {
        let _ = std::fs::remove_file(f);
    }
}

// ---------------------------------------------------------------------------------------------
// Hostile archives

/// Unpacks `archive` (gzip or not) into a fresh directory.
fn unpack(archive: &str, dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    cmd("tar", ["-xf", archive, "-C", dir.to_str().unwrap()]).ok();
}

/// Packs `dir` into `archive` as Podman and planarian lay their archives out.
fn pack(dir: &Path, archive: &str) {
    let _ = std::fs::remove_file(archive);
    let z = if archive.ends_with(".gz") { "-czf" } else { "-cf" };
    cmd("tar", [z, archive, "-C", dir.to_str().unwrap(), "."]).ok();
}

/// Whether Podman knows a container of that name.
fn exists(name: &str) -> bool {
    podman("planarian", &["container", "exists", name]).code == Some(0)
}

/// Every file of a directory with its inode and link count: what a hard link from elsewhere,
/// or a change, would show.
fn files_of(dir: &Path) -> Vec<(String, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<(String, u64, u64)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let m = e.metadata().unwrap();
            (e.file_name().to_string_lossy().into_owned(), m.ino(), m.nlink())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn crafted_archives_are_refused_with_one_line_and_change_nothing() {
    require_stack!();
    // A victim whose statepoint a crafted archive tries to reach, and an archive of our own.
    let victim = Sandbox::start("victim", 8, &[]);
    let vsp = victim.snapshot("secret");
    let vimages = store_of(&victim.id()).join("statepoints").join(&vsp).join("criu");
    let vfiles = files_of(&vimages);
    let sb = Sandbox::start("crafter", 8, &[]);
    let sp = sb.snapshot("mine");
    let podman_archive = "/tmp/planarian-crafted-src.tar.gz";
    let _ = std::fs::remove_file(podman_archive);
    podman(
        "planarian",
        &["container", "checkpoint", "--leave-running", &format!("--export={podman_archive}"), &sb.name],
    )
    .ok();
    let own_archive = "/tmp/planarian-crafted-src.tar";
    planarian(&["statepoint", "export", &sb.name, &sp, own_archive]).ok();
    let work = Path::new("/tmp/planarian-crafted");
    // The stores that hold statepoints.
    let stores = || -> std::collections::BTreeSet<PathBuf> {
        std::fs::read_dir("/var/lib/planarian/containers")
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| std::fs::read_dir(p.join("statepoints")).is_ok_and(|mut r| r.next().is_some()))
            .collect()
    };
    let before = stores();

    // 1. Podman's import of an archive whose chain leads into the victim's statepoint.
    unpack(podman_archive, work);
    let parent = work.join("checkpoint/parent");
    let _ = std::fs::remove_file(&parent);
    std::os::unix::fs::symlink(&vimages, &parent).unwrap();
    pack(work, "/tmp/planarian-crafted-1.tar.gz");
    let r =
        podman("planarian", &["container", "restore", "--import=/tmp/planarian-crafted-1.tar.gz", "--name", "evil1"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("refused, nothing was read from it") && r.stderr.contains("is a link to"), "{r:?}");
    assert!(!podman("planarian", &["ps", "--format", "{{.Names}}"]).out().contains("evil1"), "nothing runs");
    let _ = podman("planarian", &["rm", "-f", "-t", "0", "evil1"]);

    // 2. The same without planarian's part, its marker naming the victim's statepoint.
    unpack(podman_archive, work);
    std::fs::remove_dir_all(work.join("checkpoint/planarian")).unwrap();
    let marker = serde_json::json!({ "container-id": victim.id(), "statepoint-id": vsp });
    std::fs::write(work.join("checkpoint/planarian-statepoint.json"), marker.to_string()).unwrap();
    pack(work, "/tmp/planarian-crafted-2.tar.gz");
    let r =
        podman("planarian", &["container", "restore", "--import=/tmp/planarian-crafted-2.tar.gz", "--name", "evil2"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("not this container's"), "{r:?}");
    assert!(!podman("planarian", &["ps", "--format", "{{.Names}}"]).out().contains("evil2"), "nothing runs");
    let _ = podman("planarian", &["rm", "-f", "-t", "0", "evil2"]);

    // 3. planarian's own import: an image that is a link to the host's files, then a device.
    unpack(own_archive, work);
    let pages = std::fs::read_dir(work.join("checkpoint"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("pages-"))
        .expect("a pages image");
    std::fs::remove_file(&pages).unwrap();
    std::os::unix::fs::symlink("/etc/shadow", &pages).unwrap();
    pack(work, "/tmp/planarian-crafted-3.tar");
    let r = planarian(&["statepoint", "import", "/tmp/planarian-crafted-3.tar", "--name", "evil3"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert_eq!(r.stderr.trim().lines().count(), 1, "one line: {r:?}");
    assert!(r.stderr.contains("is a link to /etc/shadow"), "{r:?}");
    assert!(!exists("evil3"));
    std::fs::remove_file(&pages).unwrap();
    cmd("mknod", [pages.to_str().unwrap(), "c", "1", "1"]).ok();
    pack(work, "/tmp/planarian-crafted-4.tar");
    let r = planarian(&["statepoint", "import", "/tmp/planarian-crafted-4.tar", "--name", "evil4"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("is a device node"), "{r:?}");
    assert!(!exists("evil4"));

    // Nothing changed: no store made, the victim's images as they were, both sandboxes running.
    assert_eq!(stores(), before, "no statepoint was made anywhere");
    assert_eq!(files_of(&vimages), vfiles, "the victim's images: not linked from anywhere, not changed");
    let _ = std::fs::remove_dir_all(work);
    for f in [podman_archive, own_archive] {
        let _ = std::fs::remove_file(f);
    }
    for n in 1..=4 {
        let _ = std::fs::remove_file(format!("/tmp/planarian-crafted-{n}.tar{}", if n < 3 { ".gz" } else { "" }));
    }
    let _ = sb;
}
