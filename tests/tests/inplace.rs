//! Rollback in place (a running container returns to a statepoint without a stop), against the
//! real stack. The oracle: right after a rollback in place, before the sandbox runs again, a full
//! CRIU dump of it equals the statepoint — every page byte for byte, every thread's registers,
//! FPU state and signal mask, every descriptor and offset — and a CRIU restore of the same
//! statepoint (the stop-and-restore path) ends in the same state. Shapes it cannot restore take
//! that path, and a failure at each step leaves the sandbox exactly as before.

use criu_hooks::images;
use planarian_system_tests::sandbox::*;
use planarian_system_tests::*;
use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Private anonymous memory (`mmap`), a second thread, a log file held open, and commands:
/// `dirty OFF LEN`, `free OFF LEN` (MADV_DONTNEED), `sparse OFF LEN` (only the first page of each
/// 512 KiB kept: memory a transparent huge page no longer backs), `map MIB` (a new mapping, filled), `unmap`,
/// `log TEXT` (appended, the offset moves), `pipefill` / `piperead` (a pipe holding data),
/// `sigqueue` (SIGUSR1 and a real-time signal with a value queued, both blocked; a real timer and
/// a SIGTERM handler) / `sigtake` (the signals taken, the timer and the handler changed).
/// Publishes `SEQ COUNTER MD5(memory, every mapping) MAPPINGS PIPE-DATA` (MD5: see
/// sandbox::WORKLOAD), and the memory's address in `/tmp/addr`.
const WORKLOAD: &str = r#"
import ctypes, hashlib, mmap, os, random, resource, signal, sys, threading, time
random.seed(7)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGRTMIN + 1})
buf = mmap.mmap(-1, int(sys.argv[1]) << 20, flags=mmap.MAP_PRIVATE)
buf.write(random.randbytes(len(buf)))
with open("/tmp/addr", "w") as f:
    f.write("%d\n" % ctypes.addressof(ctypes.c_char.from_buffer(buf)))
extra = []
log = open("/tmp/log", "w")
pipe = None
got = "-"
n = 0
seq = 0
beats = [0]
def ticker():
    while True:
        beats[0] += 1
        time.sleep(0.2)
threading.Thread(target=ticker, daemon=True).start()
def publish():
    h = hashlib.md5(buf)
    for m in extra:
        h.update(m)
    with open("/tmp/.state", "w") as f:
        f.write("%d %d %s %d %s\n" % (seq, n, h.hexdigest(), len(extra), got))
    os.rename("/tmp/.state", "/tmp/state")
publish()
while True:
    try:
        cmd = open("/tmp/cmd").read().split()
    except FileNotFoundError:
        time.sleep(0.2)
        continue
    os.remove("/tmp/cmd")
    seq = int(cmd[0])
    if cmd[1] == "tick":
        n += 1
    elif cmd[1] == "dirty":
        off, ln = int(cmd[2]), int(cmd[3])
        buf[off:off + ln] = os.urandom(ln)
    elif cmd[1] == "free":
        buf.madvise(mmap.MADV_DONTNEED, int(cmd[2]), int(cmd[3]))
    elif cmd[1] == "sparse":
        for at in range(int(cmd[2]), int(cmd[2]) + int(cmd[3]), 512 << 10):
            buf.madvise(mmap.MADV_DONTNEED, at + 4096, (512 << 10) - 4096)
    elif cmd[1] == "map":
        m = mmap.mmap(-1, int(cmd[2]) << 20, flags=mmap.MAP_PRIVATE)
        m.write(os.urandom(len(m)))
        extra.append(m)
    elif cmd[1] == "unmap":
        extra.pop().close()
    elif cmd[1] == "log":
        log.write(cmd[2] + "\n")
        log.flush()
    elif cmd[1] == "pipefill":
        pipe = os.pipe()
        os.write(pipe[1], b"buffered")
    elif cmd[1] == "piperead":
        got = os.read(pipe[0], 100).decode()
    elif cmd[1] == "sigqueue":
        os.kill(os.getpid(), signal.SIGUSR1)
        ctypes.CDLL(None).sigqueue(os.getpid(), signal.SIGRTMIN + 1, ctypes.c_void_p(77))
        signal.setitimer(signal.ITIMER_REAL, 3000, 1000)
        signal.signal(signal.SIGTERM, lambda *a: None)
    elif cmd[1] == "cd":
        os.chdir(cmd[2])
    elif cmd[1] == "elsewhere":
        os.chdir("/tmp")
        os.umask(0o077)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        os.nice(3)
        adj = int(open("/proc/self/oom_score_adj").read())
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(adj + 50))
    elif cmd[1] == "sigtake":
        signal.sigtimedwait({signal.SIGUSR1}, 0)
        signal.sigtimedwait({signal.SIGRTMIN + 1}, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    publish()
"#;

/// Pages written ahead of the files' comparison (off by default).
const AHEAD: [&str; 2] = ["--annotation", "io.planarian.checkpoint.write_ahead=true"];

fn start(tag: &str, mib: u32, extra: &[&str]) -> Sandbox {
    let n = name(tag);
    let mib = mib.to_string();
    let mut args = vec!["run", "-d", "--name", &n, "--network", "none"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&[DEBIAN, "python3", "-c", WORKLOAD, &mib]);
    podman("planarian", &args).ok();
    let _c = Cleanup(n.clone());
    let ctr = Ctr::new(&n);
    assert!(
        wait_for(Duration::from_secs(120), || ctr.read("tmp/state").is_some_and(|s| s.split_whitespace().count() >= 3)),
        "workload did not start"
    );
    std::mem::forget(_c);
    Sandbox::attach(&n)
}

/// The whole published line: counter, checksum, mappings, what the pipe gave.
fn line(sb: &Sandbox) -> Vec<String> {
    sb.sh("cat /tmp/state").ok().out().split_whitespace().skip(1).map(String::from).collect()
}

/// What the sandbox's memory holds now (its checksum and mappings, published as it takes a
/// command: the published line alone may be a file a rollback put back).
fn memory(sb: &mut Sandbox) -> Vec<String> {
    sb.send("tick");
    line(sb)[1..].to_vec()
}

/// Rolls back with `--json`; the restore context.
fn rollback(sb: &mut Sandbox, sp: &str) -> serde_json::Value {
    let r = planarian(&["rollback", &sb.name, sp, "--json"]);
    rolled_back(sb, r)
}

/// The restore context of a finished `rollback --json`; the workload's sequence number is the
/// statepoint's again.
fn rolled_back(sb: &mut Sandbox, r: Run) -> serde_json::Value {
    r.ok();
    sb.seq = sb.read().expect("state after rollback").0;
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout))
}

fn images_of(sb: &Sandbox, sp: &str) -> PathBuf {
    sb.store().join("statepoints").join(sp).join("criu")
}

/// Every page a dump holds (through its chain), by address, outside the vDSO and vvar.
fn pages(dir: &Path, pid: u32) -> BTreeMap<u64, (PathBuf, u64)> {
    let mm = images::mm(dir, pid).unwrap();
    let special: Vec<(u64, u64)> = mm
        .vmas
        .iter()
        .filter(|v| v.is(images::VMA_AREA_VDSO | images::VMA_AREA_VVAR | images::VMA_AREA_VSYSCALL))
        .map(|v| (v.start, v.end))
        .collect();
    let mut out = BTreeMap::new();
    for r in images::memory(dir, pid).unwrap() {
        for i in 0..r.nr_pages {
            let a = r.vaddr + i * images::PAGE_SIZE;
            if !special.iter().any(|s| a >= s.0 && a < s.1) {
                out.insert(a, (r.file.clone(), r.loc.offset + i * images::PAGE_SIZE));
            }
        }
    }
    out
}

fn page(at: &(PathBuf, u64)) -> Vec<u8> {
    let mut b = vec![0u8; images::PAGE_SIZE as usize];
    std::fs::File::open(&at.0).unwrap().read_exact_at(&mut b, at.1).unwrap();
    b
}

/// The oracle: a full dump taken right after the rollback in place equals the statepoint.
fn assert_dump_equals(target: &Path, dump: &Path) {
    let tree = images::pstree(target).unwrap();
    assert_eq!(images::pstree(dump).unwrap(), tree, "process tree");
    let (tf, df) = (images::files(target).unwrap(), images::files(dump).unwrap());
    for p in &tree {
        let (t, d) = (pages(target, p.pid), pages(dump, p.pid));
        let only_t: Vec<String> = t.keys().filter(|a| !d.contains_key(a)).take(5).map(|a| format!("{a:#x}")).collect();
        let only_d: Vec<String> = d.keys().filter(|a| !t.contains_key(a)).take(5).map(|a| format!("{a:#x}")).collect();
        assert!(
            only_t.is_empty() && only_d.is_empty(),
            "process {}: pages only at the statepoint {only_t:?}, only now {only_d:?}",
            p.pid
        );
        // The kernel writes each thread's rseq CPU fields whenever it returns to user space (a
        // restore's first return does the same): those 32 bytes are the kernel's, not the
        // statepoint's.
        let rseq: Vec<(u64, u64)> = p
            .threads
            .iter()
            .filter_map(|t| images::core(target, *t).unwrap().rseq)
            .map(|(a, n)| (a, a + u64::from(n.clamp(20, 32))))
            .collect();
        let masked = |a: u64, mut b: Vec<u8>| {
            for &(s, e) in &rseq {
                for x in s.max(a)..e.min(a + images::PAGE_SIZE) {
                    b[(x - a) as usize] = 0;
                }
            }
            b
        };
        let differ: Vec<String> = t
            .iter()
            .filter(|(a, at)| masked(**a, page(at)) != masked(**a, page(&d[a])))
            .take(5)
            .map(|(a, at)| {
                let (x, y) = (page(at), page(&d[a]));
                let offs: Vec<usize> = (0..x.len()).filter(|i| x[*i] != y[*i]).take(8).collect();
                format!("{a:#x} (bytes {offs:?})")
            })
            .collect();
        assert!(
            differ.is_empty(),
            "process {}: {} pages, these differ: {differ:?} (rseq areas {rseq:x?})",
            p.pid,
            t.len()
        );
        eprintln!("process {}: {} pages equal", p.pid, t.len());
        for tid in &p.threads {
            let (ct, cd) = (images::core(target, *tid).unwrap(), images::core(dump, *tid).unwrap());
            let regs = |c: &images::Core| {
                c.gpregs.iter().enumerate().filter(|(i, _)| *i != 15).map(|(_, v)| *v).collect::<Vec<u64>>()
            };
            assert_eq!(
                regs(&cd),
                regs(&ct),
                "thread {tid}: registers (orig_ax aside: the rollback clears it, as a sigreturn does)"
            );
            assert_eq!(cd.fpregs.fxsave[..416], ct.fpregs.fxsave[..416], "thread {tid}: x87/SSE state");
            assert_eq!(cd.fpregs.ymmh, ct.fpregs.ymmh, "thread {tid}: AVX upper halves");
            assert_eq!(cd.blocked, ct.blocked, "thread {tid}: signal mask");
            assert_eq!(cd.signals, ct.signals, "thread {tid}: its queued signals");
            assert_eq!(cd.altstack, ct.altstack, "thread {tid}: its alternate signal stack");
        }
        // The process's queued signals (each siginfo byte for byte), dispositions and timers
        // (the same intervals; the time left, less by what passed since).
        let (lt, ld) = (images::core(target, p.pid).unwrap(), images::core(dump, p.pid).unwrap());
        assert_eq!(ld.shared_signals, lt.shared_signals, "process {}: queued signals", p.pid);
        // What the process is besides: limits, oom_score_adj, personality, subreaper flag, each
        // thread's credentials and scheduling, its umask and working directory.
        assert_eq!(
            (ld.personality, &ld.rlimits, ld.oom_score_adj, ld.child_subreaper),
            (lt.personality, &lt.rlimits, lt.oom_score_adj, lt.child_subreaper),
            "process {}: personality, limits, oom_score_adj, subreaper",
            p.pid
        );
        for tid in &p.threads {
            let (ct, cd) = (images::core(target, *tid).unwrap(), images::core(dump, *tid).unwrap());
            assert_eq!((cd.sched, &cd.creds, cd.seccomp_mode), (ct.sched, &ct.creds, ct.seccomp_mode), "thread {tid}");
        }
        let (fst, fsd) = (images::fs(target, p.pid).unwrap(), images::fs(dump, p.pid).unwrap());
        let dir = |files: &std::collections::HashMap<u32, images::File>, id: u32| match files.get(&id) {
            Some(images::File::Regular { name, .. }) => name.clone(),
            other => panic!("process {}: its working directory is {other:?}", p.pid),
        };
        assert_eq!(
            (fsd.umask, dir(&df, fsd.cwd_id)),
            (fst.umask, dir(&tf, fst.cwd_id)),
            "process {}: umask and working directory",
            p.pid
        );
        assert_eq!(ld.sigactions, lt.sigactions, "process {}: signal dispositions", p.pid);
        assert_eq!(ld.posix_timers.len(), lt.posix_timers.len(), "process {}: POSIX timers", p.pid);
        for (d, t) in ld.itimers.unwrap().iter().zip(lt.itimers.unwrap().iter()) {
            assert_eq!((d.interval, d.armed()), (t.interval, t.armed()), "process {}: interval timers", p.pid);
            assert!(d.value <= t.value && d.value.0 + 600 > t.value.0, "process {}: {d:?} now, {t:?} then", p.pid);
        }
        let id = images::files_id(target, p.pid).unwrap();
        let did = images::files_id(dump, p.pid).unwrap();
        let fds = |dir: &Path,
                   id: u32,
                   files: &std::collections::HashMap<u32, images::File>|
         -> Vec<(u32, u32, Option<u64>)> {
            let mut v: Vec<(u32, u32, Option<u64>)> = images::fdinfo(dir, id)
                .unwrap()
                .iter()
                .map(|f| {
                    (
                        f.fd,
                        f.kind,
                        match files.get(&f.id) {
                            Some(images::File::Regular { pos, .. }) => Some(*pos),
                            _ => None,
                        },
                    )
                })
                .collect();
            v.sort();
            v
        };
        assert_eq!(fds(dump, did, &df), fds(target, id, &tf), "process {}: descriptors, kinds and offsets", p.pid);
    }
}

/// Pages of process `pid` in `[lo, hi)` (present, not the zero page).
fn present(pid: u32, lo: u64, hi: u64) -> u64 {
    let zero = sys::proc::pagemap::zero_pfn();
    sys::proc::pagemap::pages(pid as i32, lo, hi, zero).unwrap().iter().map(|r| (r.1 - r.0) / images::PAGE_SIZE).sum()
}

/// Rolls back with `--json`, paused after its plan (the sandbox frozen, its pages compared)
/// while zeroed pages appear in holes of its memory: what khugepaged, which ignores the
/// freezer, does when it collapses a 2 MiB range a process has a few pages in. (It cannot be
/// made to collapse one on demand here: the guest kernel, 6.1, has no `process_madvise`
/// MADV_COLLAPSE; the pages are written through `/proc/PID/mem`, as the collapse leaves them:
/// present, zero, in neither dump.) The restore context.
fn rollback_with_strays(sb: &mut Sandbox, sp: &str, holes: &[u64]) -> serde_json::Value {
    let pid: u32 =
        podman("planarian", &["inspect", "--format", "{{.State.Pid}}", &sb.name]).ok().out().parse().unwrap();
    let paused = Path::new("/run/planarian/paused");
    let _ = std::fs::remove_file(paused);
    std::fs::write(FAULT, "pause:rollback.in-place.files").unwrap();
    let r = std::thread::scope(|s| {
        let name = sb.name.clone();
        let rb = s.spawn(move || planarian(&["rollback", &name, sp, "--json"]));
        let reached = wait_for(Duration::from_secs(300), || paused.exists() || rb.is_finished());
        if !paused.exists() {
            let _ = std::fs::remove_file(FAULT);
            let said = if reached { format!("{:?}", rb.join().unwrap()) } else { "(still running)".into() };
            panic!("the rollback did not pause after its plan: {said}");
        }
        let mem = std::fs::OpenOptions::new().write(true).open(format!("/proc/{pid}/mem")).unwrap();
        for &a in holes {
            mem.write_all_at(&[0u8; images::PAGE_SIZE as usize], a).unwrap();
        }
        // Each hole now has a page: the one written, or the real khugepaged's, which may have
        // collapsed the range already (it ignores the freezer), so pages are not counted.
        let empty: Vec<&u64> = holes.iter().filter(|&&a| present(pid, a, a + images::PAGE_SIZE) == 0).collect();
        std::fs::remove_file(paused).unwrap();
        assert!(empty.is_empty(), "no page at {empty:x?} in the frozen sandbox's memory after the writes");
        rb.join().unwrap()
    });
    rolled_back(sb, r)
}

/// Runs `planarian rollback NAME SP --json` with its files' comparison held until the pages
/// were written ahead (the comparison paused, the journal saying forward: the planning thread
/// found the comparison under way and went on to write), then `then` in the fault file (a point
/// to fail at; empty: none) and the comparison let go. Its run.
fn rollback_ahead(sb: &Sandbox, sp: &str, then: &str) -> Run {
    let paused = Path::new("/run/planarian/paused");
    let _ = std::fs::remove_file(paused);
    std::fs::create_dir_all("/run/planarian").unwrap();
    std::fs::write(FAULT, "pause:rollback.in-place.comparing").unwrap();
    let journal = sb.store().join("rolling-back.json");
    let forward = || std::fs::read_to_string(&journal).is_ok_and(|j| j.contains("\"phase\":\"forward\""));
    std::thread::scope(|s| {
        let name = sb.name.clone();
        let rb = s.spawn(move || planarian(&["rollback", &name, sp, "--json"]));
        let reached = wait_for(Duration::from_secs(300), || (paused.exists() && forward()) || rb.is_finished());
        if !(paused.exists() && forward()) {
            let _ = std::fs::remove_file(FAULT);
            let _ = std::fs::remove_file(paused);
            let said = if reached { format!("{:?}", rb.join().unwrap()) } else { "(still running)".into() };
            panic!("the rollback did not write pages ahead of its files' comparison: {said}");
        }
        if !then.is_empty() {
            std::fs::write(FAULT, then).unwrap();
        }
        std::fs::remove_file(paused).unwrap();
        rb.join().unwrap()
    })
}

fn arm_oracle(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all("/run/planarian").unwrap();
    std::fs::write("/run/planarian/oracle", dir.display().to_string()).unwrap();
}

#[test]
fn a_rollback_in_place_equals_the_statepoint_and_a_restore_of_it() {
    require_stack!();
    let _d = Disarm;
    let mut sb = start("inplace", 16, &[]);
    sb.sh("echo kept > /root/f; echo original > /etc/motd.planarian; mkdir /root/wd").ok();
    // (its working directory a directory the rollback has to bring back: set after the files)
    sb.send("cd /root/wd");
    sb.send("tick");
    sb.send("log before");
    // A few pages in each 2 MiB of 4 MiB: what a transparent huge page backed no longer does.
    sb.send("sparse 8388608 4194304");
    sb.send("sigqueue");
    let addr: u64 = sb.sh("cat /tmp/addr").ok().out().parse().unwrap();
    let at_sp = line(&sb);
    let sp = sb.snapshot("target");
    let files_then = sb.sh("cat /root/f /etc/motd.planarian /tmp/log; ls /tmp").ok().out();

    // Everything an agent's process does between two tool calls: memory rewritten, freed and
    // newly mapped, a file it holds appended to, files created, changed and removed, commands
    // exec'd that came and went.
    sb.send("dirty 1048576 2097152");
    sb.send("free 4194304 2097152");
    sb.send("map 2");
    sb.send("log after");
    sb.send("sigtake");
    sb.send("elsewhere");
    sb.sh("rm /root/f; rmdir /root/wd; echo changed > /etc/motd.planarian; echo new > /tmp/new; echo overwritten > /etc/hostname.planarian").ok();
    sb.exec("ls / > /dev/null").ok();
    assert_ne!(line(&sb), at_sp);

    let oracle = PathBuf::from("/var/tmp/planarian-oracle");
    arm_oracle(&oracle);
    // Pages that appear between the dump of the current state and the writes (khugepaged).
    let sparse = addr + (8 << 20);
    let ctx = rollback_with_strays(
        &mut sb,
        &sp,
        &[sparse + 2 * 4096, sparse + (512 << 10) + 4096, sparse + (3 << 20) + 8 * 4096],
    );
    assert_eq!(ctx["how"]["path"], "in-place", "{ctx}");
    let written = ctx["how"]["pages-written"].as_u64().unwrap();
    assert!(written > 0 && written < 4096, "{ctx}");
    assert!(ctx["restored"][0].as_str().unwrap().contains("in place"), "{ctx}");
    let rb = &sb.manifest(&sp)["rollbacks"][0];
    assert_eq!(
        (&rb["path"], rb["pages-written"].as_u64()),
        (&serde_json::json!("in-place"), Some(written)),
        "the manifest says it too: {rb}"
    );
    assert!(!Path::new("/run/planarian/oracle").exists(), "the oracle dump was not taken");
    assert_dump_equals(&images_of(&sb, &sp), &oracle);
    let queued = images::core(&images_of(&sb, &sp), 1).unwrap().shared_signals;
    assert_eq!(queued.len(), 2, "the statepoint has the two queued signals");

    // What the sandbox itself sees: the statepoint's memory, mappings, files and log offset.
    assert_eq!(line(&sb), at_sp);
    assert_eq!(sb.sh("cat /root/f /etc/motd.planarian /tmp/log; ls /tmp").ok().out(), files_then);
    assert_ne!(sb.sh("test -e /etc/hostname.planarian").code, Some(0));
    assert_eq!(sb.sh("readlink /proc/1/cwd").ok().out(), "/root/wd", "in the directory the files brought back");
    let after = sb.send("tick");
    sb.send("log again");
    assert_eq!(sb.sh("cat /tmp/log").ok().out(), "before\nagain", "the log's offset went back with its content");

    // The next dump builds on the statepoint's images: incremental, small.
    let sp2 = sb.snapshot("after");
    let m = sb.manifest(&sp2);
    assert!(m["chain"]["prev-images-dir"].is_string(), "{m}");
    assert!(m["measurements"]["pages-written"].as_u64().unwrap() < 2000, "{m}");

    // The reference: the same rollback by stopping and restoring (CRIU restore) ends in the
    // same state.
    sb.send("dirty 0 65536");
    let ref_ctx = {
        let _off = DropIn::new("in-place-off", "[checkpoint]\nrollback_in_place = false\n");
        rollback(&mut sb, &sp)
    };
    assert_eq!(ref_ctx["how"]["path"], "stop-and-restore", "{ref_ctx}");
    assert!(ref_ctx["how"]["not-in-place"].as_str().unwrap().contains("rollback_in_place"), "{ref_ctx}");
    assert_eq!(line(&sb), at_sp);
    assert_eq!(sb.send("tick"), after, "a restore of the statepoint and the rollback in place agree");
    assert_eq!(sb.sh("cat /root/f /etc/motd.planarian").ok().out(), "kept\noriginal");

    // After that restore, in place again (new conmon pipes, the same tree), to the newer one.
    let ctx = rollback(&mut sb, &sp2);
    assert_eq!(ctx["how"]["path"], "in-place", "{ctx}");
    assert_eq!(sb.sh("cat /tmp/log").ok().out(), "before\nagain");
    let _ = std::fs::remove_dir_all(&oracle);
}

#[test]
fn processes_started_since_the_statepoint_end_in_a_rollback_in_place() {
    require_stack!();
    let _d = Disarm;
    let mut sb = start("inplace-later", 8, &[]);
    sb.send("tick");
    let at_sp = line(&sb);
    let sp = sb.snapshot("one-process");
    let init = podman("planarian", &["inspect", "--format", "{{.State.Pid}}", &sb.name]).ok().out();
    let comms = |sb: &Sandbox| sb.sh("cat /proc/[0-9]*/comm").stdout;
    let states = |sb: &Sandbox| sb.sh("cat /proc/[0-9]*/stat").stdout;
    // Since the statepoint: a server started with `podman exec -d` (which the rollback does not
    // wait for, as it would for a tool call in flight); a job a command left in the background
    // (orphaned); a command that ended and was never waited for (a zombie: init, the workload,
    // waits for no child); and memory changed.
    podman("planarian", &["exec", "-d", &sb.name, "sleep", "1000"]).ok();
    sb.exec("sleep 1001 </dev/null >/dev/null 2>&1 &").ok();
    sb.exec("true &").ok();
    // (and a server of four threads: killed, all of them end)
    const THREADS: &str = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(1000,)).start()\ntime.sleep(1000)";
    podman("planarian", &["exec", "-d", &sb.name, "python3", "-c", THREADS]).ok();
    let threads = |sb: &Sandbox| sb.sh("grep -h Threads /proc/[0-9]*/status").stdout;
    // (`podman exec` starts its command as a child of init: the `sh` that ran `true &` is the
    // zombie, once both ended)
    let zombie = |sb: &Sandbox| states(sb).lines().any(|l| l.contains(") Z "));
    assert!(
        wait_for(Duration::from_secs(30), || comms(&sb).matches("sleep").count() == 2
            && zombie(&sb)
            && threads(&sb).lines().any(|l| l.ends_with("\t4"))),
        "the later processes did not start: {}",
        states(&sb)
    );
    sb.send("dirty 0 65536");
    assert_ne!(line(&sb), at_sp);

    let oracle = PathBuf::from("/var/tmp/planarian-oracle-later");
    arm_oracle(&oracle);
    let ctx = rollback(&mut sb, &sp);
    assert_eq!(ctx["how"]["path"], "in-place", "{ctx}");
    let ended = ctx["how"]["processes-ended"].as_array().cloned().unwrap_or_default();
    assert_eq!(ended.len(), 3, "the two sleeps and the server, named: {ctx}");
    let named = |comm: &str| ended.iter().filter(|e| e.as_str().unwrap().ends_with(comm)).count();
    assert_eq!((named("(sleep)"), named("(python3)")), (2, 1), "{ctx}");
    // (and the text the agent reads says so)
    let restored = ctx["restored"][0].as_str().unwrap();
    assert!(restored.contains("ended, as the statepoint does not have them: process"), "{ctx}");
    // Right after the rollback, before anything ran: the statepoint's tree, no zombie, its pages.
    assert!(!Path::new("/run/planarian/oracle").exists(), "the oracle dump was not taken");
    assert_dump_equals(&images_of(&sb, &sp), &oracle);
    let _ = std::fs::remove_dir_all(&oracle);
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Pid}}", &sb.name]).ok().out(), init);
    assert!(!comms(&sb).contains("sleep"), "the later processes are gone: {}", comms(&sb));
    assert!(!states(&sb).contains(") Z"), "no zombie is left: {}", states(&sb));
    let left = threads(&sb);
    assert!(!left.lines().any(|l| l.ends_with("\t4")), "the server's threads are gone: {left}");
    assert_eq!(comms(&sb).matches("python3").count(), 1, "the workload alone: {}", comms(&sb));
    assert_eq!(line(&sb), at_sp);
    let after = sb.send("tick");

    // The reference: the same by stopping and restoring ends in the same state.
    sb.exec("sleep 1002 </dev/null >/dev/null 2>&1 &").ok();
    let ref_ctx = {
        let _off = DropIn::new("in-place-off", "[checkpoint]\nrollback_in_place = false\n");
        rollback(&mut sb, &sp)
    };
    assert_eq!(ref_ctx["how"]["path"], "stop-and-restore", "{ref_ctx}");
    assert_eq!(line(&sb), at_sp);
    assert_eq!(sb.send("tick"), after, "a restore of the statepoint and the rollback in place agree");
    assert!(!comms(&sb).contains("sleep"), "{}", comms(&sb));
}

#[test]
fn shapes_a_rollback_in_place_cannot_restore_stop_and_restore() {
    require_stack!();
    let mut sb = start("inplace-shape", 8, &[]);
    // A pipe that held data at the statepoint: only a restore puts the data back.
    sb.send("pipefill");
    let sp2 = sb.snapshot("pipe");
    let ctx = rollback(&mut sb, &sp2);
    assert_eq!(ctx["how"]["path"], "stop-and-restore", "{ctx}");
    assert!(ctx["how"]["not-in-place"].as_str().unwrap().contains("pipe"), "{ctx}");
    sb.send("piperead");
    assert_eq!(line(&sb).last().unwrap(), "buffered");
}

const FAULT: &str = "/run/planarian/fault";

struct Disarm;
impl Drop for Disarm {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(FAULT);
        // (a rollback paused by a test that failed goes on)
        let _ = std::fs::remove_file("/run/planarian/paused");
    }
}

#[test]
fn repeated_rollbacks_in_place_and_a_failure_at_each_step() {
    require_stack!();
    let _d = Disarm;
    let mut sb = start("inplace-again", 8, &[AHEAD[0], AHEAD[1]]);
    sb.send("tick");
    let at1 = line(&sb);
    let sp1 = sb.snapshot("one");
    sb.send("map 1");
    sb.send("dirty 0 1048576");
    sb.sh("echo two > /root/two").ok();
    let at2 = line(&sb);
    let sp2 = sb.snapshot("two");
    // Back and forth, to the same statepoint twice: each time exactly there, in place.
    for (sp, want, two) in [(&sp1, &at1, false), (&sp2, &at2, true), (&sp1, &at1, false), (&sp1, &at1, false)] {
        sb.send("dirty 65536 65536");
        sb.sh("echo x > /root/scratch").ok();
        let ctx = rollback(&mut sb, sp);
        assert_eq!(ctx["how"]["path"], "in-place", "{sp}: {ctx}");
        assert_eq!(&line(&sb), want, "{sp}");
        assert_eq!(sb.sh("test -e /root/two").code == Some(0), two, "{sp}");
        assert_ne!(sb.sh("test -e /root/scratch").code, Some(0), "{sp}");
    }
    // The step before the point of no return made to fail (the remote state's compensation,
    // the first change): the sandbox is exactly as it was (memory, mappings, files), thawed.
    // Pages written ahead of the files' comparison (memory the process has, changed since the
    // statepoint and not since the last dump: the pages written before a statepoint taken since)
    // are put back first: the memory's checksum is the one before.
    sb.send("map 1");
    sb.send("dirty 65536 65536");
    sb.snapshot("later");
    sb.send("dirty 131072 65536");
    sb.sh("echo now > /root/now").ok();
    let before = line(&sb);
    let r = rollback_ahead(&sb, &sp2, "rollback.in-place.compensating");
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("rollback failed, the container and its remote state are as they were before")
            && r.stderr.contains("rollback.in-place.compensating"),
        "{r:?}"
    );
    assert!(!Path::new(FAULT).exists(), "the fault never fired");
    assert!(r.stderr.contains("pages written ahead put back"), "{}", r.stderr);
    assert_eq!(line(&sb), before, "as before");
    assert_eq!(memory(&mut sb), before[1..], "the memory as before (the pages written ahead put back)");
    assert_eq!(sb.sh("cat /root/now").ok().out(), "now");
    assert!(!cgroup_frozen(&sb.name), "thawed");
    // Each step after it made to fail: the remote state is at the target already, so the
    // rollback goes forward — the sandbox stopped and the statepoint restored — and ends
    // exactly at the statepoint (memory, mappings, files), saying why it was not in place.
    // (a comparison of the files that fails comes before any write: the rollback refuses and
    // stops and restores, as for any refusal, and says so without "writing"; the files are
    // written first, then the memory, the registers last: the threads held from the memory to
    // the registers)
    for point in [
        "rollback.in-place.memory",
        "rollback.in-place.compared",
        "rollback.in-place.files",
        "rollback.in-place.registers",
        "rollback.in-place.written",
    ] {
        sb.send("map 1");
        sb.send("dirty 65536 65536");
        sb.snapshot(&format!("before-{point}"));
        sb.sh("echo now > /root/now").ok();
        // (the comparison's failure with pages written ahead: they are put back, then the
        // rollback refuses)
        let ctx = match point {
            "rollback.in-place.compared" => {
                let r = rollback_ahead(&sb, &sp2, point);
                assert!(r.stderr.contains("pages written ahead put back"), "{}", r.stderr);
                rolled_back(&mut sb, r)
            }
            _ => {
                std::fs::create_dir_all("/run/planarian").unwrap();
                std::fs::write(FAULT, point).unwrap();
                rollback(&mut sb, &sp2)
            }
        };
        assert!(!Path::new(FAULT).exists(), "{point}: the fault never fired");
        assert_eq!(ctx["how"]["path"], "stop-and-restore", "{point}: {ctx}");
        let why = ctx["how"]["not-in-place"].as_str().unwrap_or_default();
        let wrote = point != "rollback.in-place.compared";
        assert_eq!(why.contains("writing in place failed"), wrote, "{point}: {ctx}");
        assert!(why.contains(point), "{point}: {ctx}");
        assert_eq!(line(&sb), at2, "{point}");
        assert_ne!(sb.sh("test -e /root/now").code, Some(0), "{point}: the statepoint's files");
        assert_eq!(sb.sh("cat /root/two").ok().out(), "two", "{point}");
    }
    // And the statepoint is still there to return to, in place.
    let ctx = rollback(&mut sb, &sp2);
    assert_eq!(ctx["how"]["path"], "in-place", "{ctx}");
    assert_eq!(line(&sb), at2);
    // Pages written ahead of the files' comparison, and the rollback going on: exactly there.
    sb.send("dirty 65536 65536");
    sb.snapshot("ahead");
    sb.send("dirty 131072 65536");
    sb.sh("echo x > /root/scratch").ok();
    let oracle = PathBuf::from("/var/tmp/planarian-oracle-ahead");
    arm_oracle(&oracle);
    let r = rollback_ahead(&sb, &sp2, "");
    assert!(r.stderr.contains("written while the files were compared"), "{}", r.stderr);
    let ctx = rolled_back(&mut sb, r);
    assert_eq!(ctx["how"]["path"], "in-place", "{ctx}");
    assert!(!Path::new("/run/planarian/oracle").exists(), "the oracle dump was not taken");
    assert_dump_equals(&images_of(&sb, &sp2), &oracle);
    let _ = std::fs::remove_dir_all(&oracle);
    assert_eq!(line(&sb), at2);
    assert_eq!(memory(&mut sb), at2[1..]);
    assert_ne!(sb.sh("test -e /root/scratch").code, Some(0));
}

/// planarian killed while it holds the sandbox's threads, halfway through a rollback in place
/// (the cgroup thawed under ptrace, every signal blocked, the memory about to be written): the
/// kernel kills the held processes with it, so that no process runs on halfway put back; the
/// statepoints are intact, and after `podman start` the rollback reaches the statepoint.
#[test]
fn planarian_killed_mid_rollback_in_place_leaves_no_process_halfway() {
    require_stack!();
    let _d = Disarm;
    let mut sb = start("inplace-kill", 8, &[AHEAD[0], AHEAD[1]]);
    sb.send("tick");
    let at_sp = line(&sb);
    let sp = sb.snapshot("target");
    sb.send("dirty 0 1048576");
    sb.send("map 1");
    let before = line(&sb);
    std::fs::create_dir_all("/run/planarian").unwrap();
    std::fs::write(FAULT, "kill:rollback.in-place.memory").unwrap();
    let r = planarian(&["rollback", &sb.name, &sp]);
    assert!(r.code.is_none() || r.code == Some(137), "killed: {r:?}");
    assert!(!Path::new(FAULT).exists(), "the fault never fired");
    let status = || podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out();
    assert!(
        wait_for(Duration::from_secs(120), || status() == "exited"),
        "the held processes should have died with planarian: {}",
        status()
    );
    assert!(sb.statepoints().iter().any(|m| m["statepoint-id"] == sp.as_str()), "the statepoint is intact");
    // The next operation finishes the rollback (past its compensation there is no way back:
    // the statepoint restored, files and processes), and then does what it was asked.
    let r = planarian(&["snapshot", &sb.name, "--name", "after-the-kill"]);
    r.ok();
    assert!(r.stderr.contains(&format!("an interrupted rollback to {sp} was finished")), "{}", r.stderr);
    assert_eq!(status(), "running");
    sb.seq = sb.read().expect("state after the finished rollback").0;
    assert_ne!(line(&sb), before, "not as it was before the rollback");
    assert_eq!(line(&sb), at_sp, "at the statepoint");
    let committed_internal = std::fs::read_dir(sb.store().join("statepoints"))
        .unwrap()
        .filter_map(|e| std::fs::read(e.unwrap().path().join("manifest.json")).ok())
        .map(|b| serde_json::from_slice::<serde_json::Value>(&b).unwrap())
        .filter(|m| m["internal"] == true && m["status"] == "committed")
        .count();
    assert_eq!(committed_internal, 0, "no internal statepoint is left");
    let ctx = rollback(&mut sb, &sp);
    assert_eq!(line(&sb), at_sp, "at the statepoint ({})", ctx["how"]["path"]);
    let r = planarian(&["fsck", &sb.name]);
    assert_eq!(r.code, Some(0), "fsck: {}{}", r.stdout, r.stderr);

    // Killed right after it wrote pages ahead of its files' comparison (the comparison held, the
    // sandbox frozen, not yet held by ptrace; the journal says forward from before the first
    // page): the next operation finishes the rollback, at the statepoint.
    let memory_at_sp = memory(&mut sb);
    sb.send("dirty 0 1048576");
    sb.snapshot("dirtied");
    sb.send("dirty 2097152 65536");
    let before = memory(&mut sb);
    assert_ne!(before, memory_at_sp);
    let paused = Path::new("/run/planarian/paused");
    let _ = std::fs::remove_file(paused);
    std::fs::write(FAULT, "pause:rollback.in-place.comparing\nkill:rollback.in-place.written-ahead\n").unwrap();
    let mut child = std::process::Command::new(planarian_bin())
        .args(["rollback", &sb.name, &sp])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ended = wait_for(Duration::from_secs(300), || child.try_wait().unwrap().is_some());
    if !ended {
        let _ = child.kill();
    }
    let status = child.wait().unwrap();
    let _ = std::fs::remove_file(paused);
    assert!(!Path::new(FAULT).exists(), "both points fired (what is left: {:?})", std::fs::read_to_string(FAULT));
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "killed at the point: {status:?}");
    let r = planarian(&["snapshot", &sb.name, "--name", "after-the-second-kill"]);
    r.ok();
    assert!(r.stderr.contains(&format!("an interrupted rollback to {sp} was finished")), "{}", r.stderr);
    assert_eq!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(), "running");
    sb.seq = sb.read().expect("state after the finished rollback").0;
    assert_eq!(memory(&mut sb), memory_at_sp, "at the statepoint");

    // The comparison failed after pages were written ahead, and putting them back failed too
    // (both injected): the sandbox is stopped, not left half-written, and the next operation
    // finishes the rollback, at the statepoint.
    sb.send("dirty 0 1048576");
    sb.snapshot("dirtied-again");
    let r = rollback_ahead(&sb, &sp, "rollback.in-place.compared\nrollback.in-place.put-back");
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("rollback.in-place.put-back") && r.stderr.contains("the sandbox is stopped"),
        "{}",
        r.stderr
    );
    assert!(!Path::new(FAULT).exists(), "both points fired");
    assert_ne!(podman("planarian", &["inspect", "--format", "{{.State.Status}}", &sb.name]).out(), "running");
    let r = planarian(&["snapshot", &sb.name, "--name", "after-the-put-back-failed"]);
    r.ok();
    assert!(r.stderr.contains(&format!("an interrupted rollback to {sp} was finished")), "{}", r.stderr);
    sb.seq = sb.read().expect("state after the finished rollback").0;
    assert_eq!(memory(&mut sb), memory_at_sp, "at the statepoint");
}
