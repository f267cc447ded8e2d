//! Memory on demand (`checkpoint.lazy_pages`): a fork and a rollback that restores run before
//! their memory is all there — planarian's page server installs each page of the statepoint's
//! chain as it is touched, the rest in the background — and yet start exactly at the statepoint
//! (the whole memory's checksum, a child forked before the pages are in), and their first
//! snapshot is incremental (the settling leaves soft-dirty only what differs). A server killed
//! with pages still to serve stops the container instead of letting it read zeros, and the next
//! snapshot says why.

use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;
use std::path::{Path, PathBuf};

const LAZY: &str = "io.planarian.checkpoint.lazy_pages=true";
/// On demand whatever the size (the tests' sandboxes are small).
const ANY_SIZE: &str = "io.planarian.checkpoint.lazy_pages_min_mib=0";
const FAULT: &str = "/run/planarian/fault";
const PAUSED: &str = "/run/planarian/paused";

/// Arms a fault point (see the engine's fault module), disarmed and released when dropped.
struct Armed;

impl Armed {
    fn new(what: &str) -> Armed {
        std::fs::create_dir_all(Path::new(FAULT).parent().unwrap()).unwrap();
        std::fs::write(FAULT, what).unwrap();
        Armed
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(FAULT);
        let _ = std::fs::remove_file(PAUSED);
    }
}

fn status(name: &str) -> String {
    podman("planarian", &["inspect", "--format", "{{.State.Status}}", name]).out()
}

fn fork(src: &Sandbox, sp: &str, new: &str) -> Run {
    cmd(planarian_bin().to_str().unwrap(), ["fork", &src.name, sp, "--name", new, "--json"])
}

fn forked(r: &Run) -> Sandbox {
    r.ok();
    let ctx: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    Sandbox::attach(ctx["container"].as_str().unwrap())
}

/// What the page server of `name`'s last restore wrote when it ended: what it served, then how
/// settling went (its log in the restore's work directory, in the container's bundle).
fn server_log(name: &str) -> String {
    std::fs::read_to_string(server_log_path(name)).unwrap_or_default()
}

fn server_log_path(name: &str) -> PathBuf {
    let dir = podman("planarian", &["inspect", "--format", "{{.StaticDir}}", name]).ok().out();
    PathBuf::from(dir).join("planarian-restore/lazy-pages.log")
}

/// A number after `key: ` in the server's log.
fn field(log: &str, key: &str) -> u64 {
    let at = log.find(&format!("{key}: ")).unwrap_or_else(|| panic!("no {key} in {log:?}")) + key.len() + 2;
    log[at..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().unwrap()
}

#[test]
fn a_lazy_fork_of_an_incremental_statepoint_is_exact_and_snapshots_incrementally() {
    require_stack!();
    let mut src = Sandbox::start("lzsrc", 64, &["--annotation", LAZY, "--annotation", ANY_SIZE]);
    src.snapshot("base");
    src.send("dirty 0 655360");
    let at_sp = src.send("tick");
    let sp = src.snapshot("fork-point");
    src.assert_incremental(&sp, 1, 2_048);
    // What a child forked at the statepoint computes, on the source (restored whole: it never
    // was restored).
    src.send("fork 11");
    let (_, want_child) = src.child();
    src.send("reap");
    src.send("dirty 1048576 65536");

    // The server holds its background transfer (it serves faults only) until released: the child
    // below is forked while nearly every page is still the server's to install.
    let armed = Armed::new("hold:lazy.background");
    let mut f = forked(&fork(&src, &sp, &name("lzf")));
    assert!(!Path::new(FAULT).exists() && Path::new(PAUSED).exists(), "the hold was not taken");
    // A child forked: it starts with what its parent still misses.
    f.send("fork 11");
    let (_, child) = f.child();
    assert_eq!(child, want_child, "the child of a lazily restored process");
    f.send("reap");
    let now = f.send("tick");
    assert_eq!(
        (now.counter, &now.checksum),
        (at_sp.counter + 1, &at_sp.checksum),
        "the fork's memory is the statepoint's"
    );

    // Its first snapshot waits for every page and the settling, and is incremental. The transfer
    // held, the pages cannot all be in: the snapshot hurries the server (which says so at once)
    // and waits; released, the rest goes at normal priority.
    let log_path = server_log_path(&f.name);
    let snap = {
        let n = f.name.clone();
        std::thread::spawn(move || cmd(planarian_bin().to_str().unwrap(), ["snapshot", &n, "--name", "f1"]))
    };
    assert!(
        wait_for(std::time::Duration::from_secs(300), || snap.is_finished()
            || std::fs::read_to_string(&log_path).is_ok_and(|l| l.starts_with("hurried"))),
        "the waiting snapshot did not hurry the server"
    );
    drop(armed);
    let r = snap.join().unwrap();
    r.ok();
    let f1 = r.out();
    let log = server_log(&f.name);
    assert!(
        log.contains("hurried: true") && field(&log, "idle_runs") == 0,
        "held until hurried, no background run was idle: {log}"
    );
    assert!(field(&log, "lazy_pages") > 15_000, "64 MiB left to the server, most of it in the parent dump: {log}");
    assert!(field(&log, "forks") >= 1 && field(&log, "on_fault") > 1_000, "{log}");
    // Settling found the pages the server installed soft-dirty, and marked again only those that
    // differ from the statepoint (what the fork wrote before it settled).
    assert!(field(&log, "soft_dirty") > 10_000 && field(&log, "differ") < 1_000, "{log}");
    assert!(!store_of(&f.name).join("lazy-pages.json").exists(), "settled: no marker left");
    // (the fork point is the second of its chain)
    f.assert_incremental(&f1, 2, 2_048);

    // A rollback in place within the fork, and its memory again.
    f.send("dirty 0 1000000");
    f.rollback(&f1);
    assert_eq!(f.send("tick").checksum, at_sp.checksum);
}

/// A sandbox of 64 MiB whose rollbacks stop and restore, its memory on demand.
fn restoring_lazily(tag: &str) -> Sandbox {
    Sandbox::start(
        tag,
        64,
        &[
            "--annotation",
            LAZY,
            "--annotation",
            ANY_SIZE,
            "--annotation",
            "io.planarian.checkpoint.rollback_in_place=false",
        ],
    )
}

/// `sb` rolled back to `sp`, its settling paused while it holds the container frozen (until
/// [`PAUSED`] is removed); the armed fault.
fn rolled_back_settling(sb: &Sandbox, sp: &str) -> Armed {
    let armed = Armed::new("pause:lazy.settling");
    cmd(planarian_bin().to_str().unwrap(), ["rollback", &sb.name, sp]).ok();
    assert!(wait_for(std::time::Duration::from_secs(300), || Path::new(PAUSED).exists()), "settling never froze");
    armed
}

#[test]
fn a_rollback_that_restores_lazily_is_exact_and_a_pause_or_an_exec_while_it_settles_waits() {
    require_stack!();
    let mut sb = restoring_lazily("lzrb");
    sb.snapshot("base");
    sb.send("dirty 4096 655360");
    let at_sp = sb.send("tick");
    let sp = sb.snapshot("target");
    sb.send("dirty 0 4000000");

    // Settling holds the restored container frozen for a moment, after the rollback returned: a
    // `podman pause` that comes then waits for it, and is not undone by its thaw.
    let armed = rolled_back_settling(&sb, &sp);
    // (looked up first: while Podman's pause waits, it holds the container's lock, and a
    // `podman inspect` waits for it)
    let lock = store_of(&sb.name).join("freeze.lock");
    let name = sb.name.clone();
    // (bounded: a pause that never gets the lock fails the test instead of hanging it)
    let pause = std::thread::spawn(move || cmd("timeout", ["300", "podman", "--runtime", "planarian", "pause", &name]));
    // (the runtime's `pause` waiting for the store's freeze lock)
    assert!(
        wait_for(std::time::Duration::from_secs(120), || lock_waited_for(&lock)),
        "the pause did not wait for the settling"
    );
    std::fs::remove_file(PAUSED).unwrap();
    pause.join().unwrap().ok();
    drop(armed);
    // Settled (its marker gone), and the container still paused: frozen, as Podman says.
    assert!(wait_for(std::time::Duration::from_secs(300), || !store_of(&sb.name).join("lazy-pages.json").exists()));
    // Nobody waited for the memory: the background transfer ran as the idle class, and ended.
    let log = server_log(&sb.name);
    assert!(field(&log, "idle_runs") > 0 && log.contains("hurried: false"), "{log}");
    assert_eq!(status(&sb.name), "paused");
    assert!(cgroup_frozen(&sb.name), "paused, but running");
    podman("planarian", &["unpause", &sb.name]).ok();

    sb.seq = sb.read().expect("state after rollback").0;
    assert_eq!(sb.send("tick").checksum, at_sp.checksum);
    sb.send("dirty 8388608 65536");
    let at_next = sb.send("tick");
    let next = sb.snapshot("after");
    assert!(field(&server_log(&sb.name), "lazy_pages") > 15_000, "{}", server_log(&sb.name));
    sb.assert_incremental(&next, 2, 2_048);

    // A `podman exec` that comes while settling holds the restored container frozen waits for it
    // (crun refuses to start a command in a frozen container: "is paused"), and runs.
    sb.send("dirty 0 4000000");
    let armed = rolled_back_settling(&sb, &next);
    assert!(cgroup_frozen(&sb.name), "settling holds the container frozen");
    let name = sb.name.clone();
    // (bounded: an exec that never gets the lock fails the test instead of hanging it)
    let exec = std::thread::spawn(move || cmd("timeout", ["300", "podman", "exec", &name, "cat", "/proc/1/comm"]));
    assert!(
        wait_for(std::time::Duration::from_secs(120), || lock_waited_for(&lock) || exec.is_finished()),
        "the exec neither waited for the settling nor ended"
    );
    let waited = !exec.is_finished();
    std::fs::remove_file(PAUSED).unwrap();
    let r = exec.join().unwrap();
    drop(armed);
    assert!(waited, "the exec did not wait for the settling: {r:?}");
    r.ok();
    sb.seq = sb.read().expect("state after the second rollback").0;
    assert_eq!(sb.send("tick").checksum, at_next.checksum);
}

#[test]
fn a_page_server_killed_with_pages_to_serve_stops_the_container_and_the_next_snapshot_says_why() {
    require_stack!();
    let mut src = Sandbox::start("lzkill", 64, &["--annotation", LAZY, "--annotation", ANY_SIZE]);
    src.send("tick");
    let sp = src.snapshot("fork-point");
    let _armed = Armed::new("kill:lazy.serving");
    let new = name("lzk");
    let _c = Cleanup(new.clone());
    // (the fork itself may end before or after its server is killed: what it says is not asked)
    let r = fork(&src, &sp, &new);
    assert!(!Path::new(FAULT).exists(), "the fault never fired: {r:?}");
    assert!(
        wait_for(std::time::Duration::from_secs(120), || status(&new) != "running"),
        "the container whose pages were lost still runs: {}\n{}",
        std::fs::read_to_string(store_of(&new).join("lazy-pages.json")).unwrap_or_default(),
        cmd("ps", ["-eo", "pid,ppid,stat,wchan:32,args"]).stdout
    );
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(store_of(&new).join("lazy-pages.json")).unwrap()).unwrap();
    assert!(marker["failed"].as_str().unwrap_or("").contains("killed"), "{marker}");
    let s = cmd(planarian_bin().to_str().unwrap(), ["snapshot", &new, "--name", "after"]);
    assert_ne!(s.code, Some(0));
    assert!(s.stderr.contains("memory") && s.stderr.contains("lost"), "{s:?}");
    // The source is untouched.
    assert_eq!(src.send("tick").counter, 2);
}

/// 256 private mappings side by side (every other one read-only), 16 MiB of seeded random data:
/// the server installs runs within one mapping at a time. `ask` makes it publish the checksum of
/// the whole area (`SEQ SUM` in /tmp/sum); `dirty` rewrites one writable mapping.
const MAPPINGS: &str = r#"
import ctypes, hashlib, mmap, os, random, time
libc = ctypes.CDLL(None, use_errno=True)
n, size = 256, 16 * 4096
m = mmap.mmap(-1, n * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.write(random.Random(5).randbytes(n * size))
at = ctypes.addressof(ctypes.c_char.from_buffer(m))
for k in range(0, n, 2):
    assert libc.mprotect(ctypes.c_void_p(at + k * size), ctypes.c_size_t(size), 1) == 0
def publish(seq):
    with open("/tmp/.sum", "w") as f:
        f.write("%s %s\n" % (seq, hashlib.md5(m[:]).hexdigest()))
    os.rename("/tmp/.sum", "/tmp/sum")
publish("start")
while True:
    for cmd in ("ask", "dirty"):
        try:
            seq = open("/tmp/" + cmd).read().strip()
        except FileNotFoundError:
            continue
        os.remove("/tmp/" + cmd)
        if cmd == "dirty":
            m[size:2 * size] = os.urandom(size)
        publish(seq)
    time.sleep(0.1)
"#;

/// Sends `cmd` (ask or dirty) as `seq` to the mappings workload in `name` and returns the sum it
/// publishes for it.
fn sum_of(name: &str, cmd: &str, seq: u32) -> String {
    podman("planarian", &["exec", name, "sh", "-c", &format!("echo {seq} > /tmp/.{cmd} && mv /tmp/.{cmd} /tmp/{cmd}")])
        .ok();
    let mut last = String::new();
    assert!(
        wait_for(std::time::Duration::from_secs(120), || {
            last = podman("planarian", &["exec", name, "cat", "/tmp/sum"]).stdout;
            last.split_whitespace().next() == Some(&seq.to_string())
        }),
        "{name} did not answer {cmd} {seq}: {last:?}"
    );
    last.split_whitespace().nth(1).unwrap().to_string()
}

#[test]
fn a_lazy_fork_of_many_mappings_side_by_side_is_exact() {
    require_stack!();
    let src = name("lzmaps");
    let _c = Cleanup(src.clone());
    podman(
        "planarian",
        &[
            "run",
            "-d",
            "--name",
            &src,
            "--network",
            "none",
            "--annotation",
            LAZY,
            "--annotation",
            ANY_SIZE,
            DEBIAN,
            "python3",
            "-c",
            MAPPINGS,
        ],
    )
    .ok();
    assert!(
        wait_for(std::time::Duration::from_secs(120), || podman(
            "planarian",
            &["exec", &src, "test", "-e", "/tmp/sum"]
        )
        .code
            == Some(0)),
        "the workload did not start"
    );
    planarian(&["snapshot", &src, "--name", "base"]).ok();
    let want = sum_of(&src, "dirty", 1);
    let sp = planarian(&["snapshot", &src, "--name", "fork-point"]).ok().out();
    let f = name("lzmapsf");
    let _cf = Cleanup(f.clone());
    fork_named(&src, &sp, &f);
    assert_eq!(sum_of(&f, "ask", 2), want, "the fork's mappings are the statepoint's");
    // (a snapshot waits for every page and the settling: then the server has said what it did)
    planarian(&["snapshot", &f]).ok();
    let log = server_log(&f);
    assert!(field(&log, "lazy_pages") >= 4_096, "the mappings were the server's to install: {log}");
}

fn fork_named(src: &str, sp: &str, new: &str) {
    cmd(planarian_bin().to_str().unwrap(), ["fork", src, sp, "--name", new]).ok();
}
