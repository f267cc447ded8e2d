//! Algorithm 1 on real CRIU, below the container layer: the first dump after a restore is
//! incremental only with planarian's pre-resume hook and the rewritten parent dump time.

use planarian_system_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn hooks_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/planarian-criu-hooks")
}

/// pages_written of the dump in `dir`, from CRIU's own stats.
fn pages_written(dir: &Path) -> u64 {
    let r = cmd("crit", ["decode", "-i", dir.join("stats-dump").to_str().unwrap()]);
    r.ok();
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    v["entries"][0]["dump"]["pages_written"].as_u64().unwrap()
}

fn criu(args: &[&str], dir: &Path) {
    let st = Command::new("criu").args(args).current_dir(dir).stdin(Stdio::null()).status().unwrap();
    if !st.success() {
        let log = std::fs::read_to_string(dir.join("dump.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(25).collect();
        panic!("criu {args:?} failed; end of its log:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
}

/// A process with 64 MiB of memory rewriting one page every 200 ms; dump, restore (with or
/// without the hook), dump again incrementally; returns pages written by the second dump.
fn second_dump_pages(work: &Path, with_hook: bool) -> u64 {
    let _ = std::fs::remove_dir_all(work);
    let (d1, d2) = (work.join("d1"), work.join("d2"));
    std::fs::create_dir_all(&d1).unwrap();
    std::fs::create_dir_all(&d2).unwrap();
    let child = Command::new("setsid")
        .args(["python3", "-c", "import os,time\nb=bytearray(os.urandom(64<<20))\nwhile True:\n b[0:4096]=os.urandom(4096); time.sleep(0.2)"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    std::thread::sleep(Duration::from_secs(2));
    criu(&["dump", "-t", &pid, "-D", d1.to_str().unwrap(), "-o", "dump.log", "--track-mem", "--leave-running"], &d1);
    let _ = cmd("kill", ["-9", &pid]);
    let mut child = child;
    let _ = child.wait();
    let epoch = work.join("epoch");
    let mut restore = Command::new("criu");
    restore.args(["restore", "-D", d1.to_str().unwrap(), "-o", "restore.log", "-d"]);
    if with_hook {
        restore.arg("--action-script").arg(hooks_bin()).env("PLANARIAN_EPOCH_FILE", &epoch);
    }
    assert!(restore.stdin(Stdio::null()).status().unwrap().success(), "criu restore failed");
    if with_hook {
        let text = std::fs::read_to_string(&epoch).expect("the pre-resume hook recorded E");
        let mut f = text.split_whitespace().map(|x| x.parse::<u64>().unwrap());
        let (e, clk) = (f.next().unwrap(), f.next().unwrap());
        cmd(hooks_bin().to_str().unwrap(), ["set-dump-uptime", d1.join("inventory.img").to_str().unwrap(), &(e * 1_000_000 / clk).to_string()]).ok();
    }
    std::thread::sleep(Duration::from_secs(1));
    criu(&["dump", "-t", &pid, "-D", d2.to_str().unwrap(), "-o", "dump.log", "--track-mem", "--prev-images-dir", "../d1", "--leave-running"], &d2);
    let _ = cmd("kill", ["-9", &pid]);
    pages_written(&d2)
}

#[test]
fn first_dump_after_restore_is_incremental_with_the_pre_resume_hook() {
    require_stack!();
    let base = Path::new("/var/lib/planarian/test-algorithm1");
    let plain = second_dump_pages(&base.join("plain"), false);
    let hooked = second_dump_pages(&base.join("hook"), true);
    let _ = std::fs::remove_dir_all(base);
    eprintln!("first dump after restore: {plain} pages without the hook, {hooked} with it");
    // 64 MiB is 16384 pages: without the hook CRIU dumps them all again. With it, only what
    // changed since the restore: a few pages, or one 2 MiB transparent huge page (512 pages,
    // soft-dirty is tracked per PMD) when khugepaged collapsed the page being rewritten.
    assert!(plain > 16_384, "{plain}");
    assert!(hooked < 1_200, "{hooked}");
}

/// A process whose private memory has holes (64 KiB of every 128 KiB given back with
/// MADV_DONTNEED) and that writes the SHA-256 of it to `work/sum` whenever `work/req` appears.
const HOLES: &str = r#"
import hashlib, mmap, os, sys, time
w = sys.argv[1]
m = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.write(os.urandom(32 << 20))
for off in range(0, 32 << 20, 128 << 10):
    m.madvise(mmap.MADV_DONTNEED, off, 64 << 10)
open(w + "/ready", "w").close()
while True:
    if os.path.exists(w + "/req"):
        os.remove(w + "/req")
        with open(w + "/.sum", "w") as f:
            f.write(hashlib.sha256(m[:]).hexdigest())
        os.rename(w + "/.sum", w + "/sum")
    time.sleep(0.05)
"#;

fn checksum(work: &Path) -> String {
    let _ = std::fs::remove_file(work.join("sum"));
    std::fs::write(work.join("req"), "").unwrap();
    assert!(wait_for(Duration::from_secs(60), || work.join("sum").exists()), "no checksum");
    std::fs::read_to_string(work.join("sum")).unwrap()
}

fn restore_with_hook(images: &Path, epoch: &Path) {
    let st = Command::new("criu")
        .args(["restore", "-D", images.to_str().unwrap(), "-o", "restore.log", "-d", "--action-script"])
        .arg(hooks_bin())
        .env("PLANARIAN_EPOCH_FILE", epoch)
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "criu restore failed (log in {})", images.display());
}

/// A restore may fill the holes of the images (a transparent huge page for a restored page,
/// khugepaged collapsing a range): those pages are present but in no image. The hook marks
/// them dirty, so the next incremental dump writes them instead of failing with "Missing … in
/// parent pagemap" (seen in CI before the fix), and the chain restores the exact memory.
#[test]
fn holes_the_restore_filled_are_dumped_not_assumed_in_the_parent() {
    require_stack!();
    let work = Path::new("/var/lib/planarian/test-algorithm1/holes");
    let _ = std::fs::remove_dir_all(work);
    let (d1, d2) = (work.join("d1"), work.join("d2"));
    std::fs::create_dir_all(&d1).unwrap();
    std::fs::create_dir_all(&d2).unwrap();
    let child = Command::new("setsid")
        .args(["python3", "-c", HOLES, work.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    assert!(wait_for(Duration::from_secs(60), || work.join("ready").exists()));
    let before = checksum(work);
    criu(&["dump", "-t", &pid, "-D", d1.to_str().unwrap(), "-o", "dump.log", "--track-mem", "--leave-running"], &d1);
    let _ = cmd("kill", ["-9", &pid]);
    let mut child = child;
    let _ = child.wait();
    let epoch = work.join("epoch");
    restore_with_hook(&d1, &epoch);
    let text = std::fs::read_to_string(&epoch).expect("the pre-resume hook recorded E");
    let mut f = text.split_whitespace().map(|x| x.parse::<u64>().unwrap());
    let (e, clk) = (f.next().unwrap(), f.next().unwrap());
    cmd(hooks_bin().to_str().unwrap(), ["set-dump-uptime", d1.join("inventory.img").to_str().unwrap(), &(e * 1_000_000 / clk).to_string()]).ok();
    assert_eq!(checksum(work), before, "memory after the first restore");
    criu(&["dump", "-t", &pid, "-D", d2.to_str().unwrap(), "-o", "dump.log", "--track-mem", "--prev-images-dir", "../d1"], &d2);
    restore_with_hook(&d2, &work.join("epoch2"));
    assert_eq!(checksum(work), before, "memory restored from the incremental chain");
    let _ = cmd("kill", ["-9", &pid]);
    let _ = std::fs::remove_dir_all(work);
}
