//! Algorithm 1 on real CRIU, below the container layer: the first dump after a restore is
//! incremental only with planarian's pre-resume hook and the rewritten parent dump time.

use planarian_system_tests::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

fn hooks_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/debug/planarian-criu-hooks")
}

/// Restores with transparent huge pages off for the restored tasks (inherited, as planarian does).
fn without_thp(c: &mut Command) {
    use std::os::unix::process::CommandExt;
    unsafe {
        c.pre_exec(|| nix::sys::prctl::set_thp_disable(true).map_err(std::io::Error::from));
    }
}

/// pages_written of the dump in `dir`, from CRIU's own stats.
fn pages_written(dir: &Path) -> u64 {
    let r = cmd("crit", ["decode", "-i", dir.join("stats-dump").to_str().unwrap()]);
    r.ok();
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    v["entries"][0]["dump"]["pages_written"].as_u64().unwrap()
}

fn criu(args: &[&str], dir: &Path) {
    if let Err(e) = try_criu(args, dir) {
        panic!("{e}");
    }
}

/// Runs criu; on failure, the error lines of its log.
fn try_criu(args: &[&str], dir: &Path) -> Result<(), String> {
    let st = Command::new("criu").args(args).current_dir(dir).stdin(Stdio::null()).status().unwrap();
    if st.success() {
        return Ok(());
    }
    let log = std::fs::read_to_string(dir.join("dump.log")).unwrap_or_default();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("Error")).collect();
    Err(format!("criu {args:?} failed:\n{}", errors.join("\n")))
}

/// The workload: 64 MiB of memory, then a file created once it is all there (every page a first
/// dump should see), then one page rewritten every 200 ms, each round touching that file's times
/// (no descriptor held open, so no dump ever catches one).
const WORKLOAD: &str = "import os,sys,time\nb=bytearray(os.urandom(64<<20))\nopen(sys.argv[1],'x').close()\nwhile True:\n b[0:4096]=os.urandom(4096); os.utime(sys.argv[1]); time.sleep(0.2)";

fn mtime(p: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// A process with 64 MiB of memory rewriting one page every 200 ms; dump, restore (with or
/// without the hook), dump again incrementally; returns pages written by the second dump, or
/// CRIU's refusal of it.
fn second_dump_pages(work: &Path, with_hook: bool) -> Result<u64, String> {
    let _ = std::fs::remove_dir_all(work);
    let (d1, d2) = (work.join("d1"), work.join("d2"));
    std::fs::create_dir_all(&d1).unwrap();
    std::fs::create_dir_all(&d2).unwrap();
    let beat = work.join("beat");
    let child = Command::new("setsid")
        .args(["python3", "-c", WORKLOAD])
        .arg(&beat)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // The first dump sees the whole buffer: one taken while it is still being filled leaves the
    // rest of it to the next dump, hook or not (the failure seen on slower machines).
    assert!(wait_for(Duration::from_secs(300), || beat.exists()), "the workload did not build its buffer within 300 s");
    criu(&["dump", "-t", &pid, "-D", d1.to_str().unwrap(), "-o", "dump.log", "--track-mem", "--leave-running"], &d1);
    let _ = cmd("kill", ["-9", &pid]);
    let mut child = child;
    let _ = child.wait();
    let epoch = work.join("epoch");
    let mut restore = Command::new("criu");
    restore.args(["restore", "-D", d1.to_str().unwrap(), "-o", "restore.log", "-d"]);
    if with_hook {
        restore.arg("--action-script").arg(hooks_bin()).env("PLANARIAN_EPOCH_FILE", &epoch);
        // As planarian restores: no transparent huge pages filling the images' holes.
        without_thp(&mut restore);
    }
    assert!(restore.stdin(Stdio::null()).status().unwrap().success(), "criu restore failed");
    if with_hook {
        let text = std::fs::read_to_string(&epoch).expect("the pre-resume hook recorded E");
        let mut f = text.split_whitespace().map(|x| x.parse::<u64>().unwrap());
        let (e, clk) = (f.next().unwrap(), f.next().unwrap());
        cmd(
            hooks_bin().to_str().unwrap(),
            ["set-dump-uptime", d1.join("inventory.img").to_str().unwrap(), &(e * 1_000_000 / clk).to_string()],
        )
        .ok();
    }
    // The restored process runs and changes a page before the second dump.
    let restored = mtime(&beat);
    assert!(wait_for(Duration::from_secs(60), || mtime(&beat) != restored), "the restored workload does not run");
    let r = try_criu(
        &[
            "dump",
            "-t",
            &pid,
            "-D",
            d2.to_str().unwrap(),
            "-o",
            "dump.log",
            "--track-mem",
            "--prev-images-dir",
            "../d1",
            "--leave-running",
        ],
        &d2,
    );
    let _ = cmd("kill", ["-9", &pid]);
    r.map(|()| pages_written(&d2))
}

#[test]
fn first_dump_after_restore_is_incremental_with_the_pre_resume_hook() {
    require_stack!();
    let base = Path::new("/var/lib/planarian/test-algorithm1");
    let plain = second_dump_pages(&base.join("plain"), false).unwrap();
    let hooked = second_dump_pages(&base.join("hook"), true).unwrap();
    let _ = std::fs::remove_dir_all(base);
    eprintln!("first dump after restore: {plain} pages without the hook, {hooked} with it");
    // 64 MiB is 16384 pages: without the hook CRIU dumps them all again. With it, only what
    // changed since the restore (a few pages; 512 if a transparent huge page got involved).
    assert!(plain > 16_384, "{plain}");
    assert!(hooked < 1_200, "{hooked}");
}
