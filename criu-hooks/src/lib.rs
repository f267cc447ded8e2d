//! CRIU image edits and process facts for continuous incremental checkpointing (Algorithm 1).
//!
//! * [`set_dump_uptime`] rewrites the `dump_uptime` of an `inventory.img` by splicing protobuf
//!   bytes, keeping every other field as it is (CRIU-NOTES.md, "inventory.img layout").
//! * [`restored_tree`], [`epoch`] and [`clear_soft_dirty`] are the pieces of the pre-resume hook.

pub mod images;

use std::path::Path;
use sys::proc::Proc;

pub const INVENTORY_MAGIC: u32 = 0x5831_3116;
const DUMP_UPTIME_FIELD: u64 = 8;

#[derive(Debug, PartialEq, Eq)]
pub enum ImageError {
    Short,
    Magic(u32),
    Length { declared: usize, actual: usize },
    Protobuf(&'static str),
}

impl std::fmt::Display for ImageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageError::Short => write!(f, "inventory image is truncated"),
            ImageError::Magic(m) => write!(f, "not an inventory image (magic {m:#x})"),
            ImageError::Length { declared, actual } => {
                write!(f, "inventory entry declares {declared} bytes, {actual} present")
            }
            ImageError::Protobuf(w) => write!(f, "malformed inventory entry: {w}"),
        }
    }
}

impl std::error::Error for ImageError {}

/// Reads one protobuf varint at `pos`, advancing it.
pub fn read_varint(b: &[u8], pos: &mut usize) -> Result<u64, ImageError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*pos).ok_or(ImageError::Protobuf("varint runs past the end"))?;
        *pos += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(ImageError::Protobuf("varint too long"))
}

/// Appends one protobuf varint.
pub fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The fields of one protobuf message as (field number, the record's bytes including its key).
pub fn records(msg: &[u8]) -> Result<Vec<(u64, &[u8])>, ImageError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < msg.len() {
        let start = pos;
        let key = read_varint(msg, &mut pos)?;
        match key & 7 {
            0 => {
                read_varint(msg, &mut pos)?;
            }
            1 => pos += 8,
            2 => {
                let len = read_varint(msg, &mut pos)? as usize;
                pos = pos.checked_add(len).ok_or(ImageError::Protobuf("length overflows"))?;
            }
            5 => pos += 4,
            _ => return Err(ImageError::Protobuf("unsupported wire type")),
        }
        if pos > msg.len() {
            return Err(ImageError::Protobuf("field runs past the end"));
        }
        out.push((key >> 3, &msg[start..pos]));
    }
    Ok(out)
}

/// Reads `dump_uptime` (µs) from an inventory image, if present.
pub fn dump_uptime(image: &[u8]) -> Result<Option<u64>, ImageError> {
    let msg = entry(image)?;
    for (field, rec) in records(msg)? {
        if field == DUMP_UPTIME_FIELD {
            let mut pos = 1;
            return Ok(Some(read_varint(rec, &mut pos)?));
        }
    }
    Ok(None)
}

fn entry(image: &[u8]) -> Result<&[u8], ImageError> {
    if image.len() < 8 {
        return Err(ImageError::Short);
    }
    let magic = u32::from_le_bytes(image[0..4].try_into().unwrap());
    if magic != INVENTORY_MAGIC {
        return Err(ImageError::Magic(magic));
    }
    let n = u32::from_le_bytes(image[4..8].try_into().unwrap()) as usize;
    if image.len() - 8 != n {
        return Err(ImageError::Length { declared: n, actual: image.len() - 8 });
    }
    Ok(&image[8..])
}

/// Returns `image` with `dump_uptime` set to `usec`: every field-8 record dropped, one inserted
/// before the first field numbered above 8 (or at the end), the length fixed. Every other byte
/// is kept, including fields this code does not know.
pub fn set_dump_uptime(image: &[u8], usec: u64) -> Result<Vec<u8>, ImageError> {
    let msg = entry(image)?;
    let mut body = Vec::with_capacity(msg.len() + 10);
    let mut inserted = false;
    for (field, rec) in records(msg)? {
        if field == DUMP_UPTIME_FIELD {
            continue;
        }
        if field > DUMP_UPTIME_FIELD && !inserted {
            body.push((DUMP_UPTIME_FIELD << 3) as u8);
            write_varint(&mut body, usec);
            inserted = true;
        }
        body.extend_from_slice(rec);
    }
    if !inserted {
        body.push((DUMP_UPTIME_FIELD << 3) as u8);
        write_varint(&mut body, usec);
    }
    let mut out = Vec::with_capacity(body.len() + 8);
    out.extend_from_slice(&INVENTORY_MAGIC.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Rewrites the file in place safely ([`sys::write_atomic`]).
pub fn rewrite_dump_uptime(path: &Path, usec: u64) -> Result<(), HookError> {
    let data = std::fs::read(path).map_err(|e| sys::IoError::new("read", path, e))?;
    let new = set_dump_uptime(&data, usec).map_err(|source| HookError::Image { path: path.to_path_buf(), source })?;
    Ok(sys::write_atomic(path, &new, 0o644)?)
}

/// Why the pre-resume step (or an image edit) did not happen.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error(transparent)]
    Io(#[from] sys::IoError),
    #[error("{}: {source}", path.display())]
    Image { path: std::path::PathBuf, source: ImageError },
    #[error("cannot read CLK_TCK")]
    ClockTicks,
    #[error("criu named no root task")]
    NoRoot,
    #[error("no restored process under {0}")]
    NoTree(i32),
    #[error("no start time of the restored threads")]
    NoStartTime,
    #[error("cannot read /proc/uptime")]
    Uptime,
    #[error("uptime did not reach E = {0} ticks")]
    Deadline(u64),
    #[error("{0} is not set")]
    NotSet(&'static str),
}

/// What CRIU's `stats-dump` image says about the memory of one dump.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DumpStats {
    pub pages_scanned: u64,
    pub pages_skipped_parent: u64,
    pub pages_written: u64,
}

const SERVICE_MAGIC: u32 = 0x5510_5940;

/// Reads a `stats-dump` image: service magic, stats magic, then one length-prefixed StatsEntry
/// whose field 1 is the DumpStatsEntry (pages_scanned 5, pages_skipped_parent 6, pages_written 7).
pub fn dump_stats(image: &[u8]) -> Result<DumpStats, ImageError> {
    let word = |at: usize| image.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let mut at = if word(0).ok_or(ImageError::Short)? == SERVICE_MAGIC { 8 } else { 4 };
    let n = word(at).ok_or(ImageError::Short)? as usize;
    at += 4;
    let msg =
        image.get(at..at + n).ok_or(ImageError::Length { declared: n, actual: image.len().saturating_sub(at) })?;
    let mut out = DumpStats::default();
    for (field, rec) in records(msg)? {
        if field != 1 {
            continue;
        }
        let mut pos = 1;
        let len = read_varint(rec, &mut pos)? as usize;
        for (f, r) in records(&rec[pos..pos + len])? {
            let mut p = 1;
            let slot = match f {
                5 => &mut out.pages_scanned,
                6 => &mut out.pages_skipped_parent,
                7 => &mut out.pages_written,
                _ => continue,
            };
            *slot = read_varint(r, &mut p)?;
        }
    }
    Ok(out)
}

/// Clock ticks to CRIU's dump_uptime unit, microseconds.
pub fn ticks_to_usec(ticks: u64, clk_tck: u64) -> u64 {
    ticks * 1_000_000 / clk_tck
}

/// The restored process tree under `root` (the init pid CRIU reports), zombies skipped.
pub fn restored_tree(root: i32) -> Vec<i32> {
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        let p = Proc::of(pid);
        match p.state_and_start() {
            Some(('Z', _)) | None => continue,
            Some(_) => out.push(pid),
        }
        for tid in p.threads().unwrap_or_default() {
            if let Ok(children) = p.task(tid).read("children") {
                todo.extend(children.split_whitespace().filter_map(|c| c.parse::<i32>().ok()));
            }
        }
    }
    out
}

/// E = 1 + the latest start time (ticks) of every thread of the given processes.
pub fn epoch(pids: &[i32]) -> Result<u64, HookError> {
    let mut latest = None::<u64>;
    for &pid in pids {
        let p = Proc::of(pid);
        for tid in p.threads().unwrap_or_default() {
            if let Some((_, start)) = p.task(tid).state_and_start() {
                latest = Some(latest.map_or(start, |l| l.max(start)));
            }
        }
    }
    latest.map(|l| l + 1).ok_or(HookError::NoStartTime)
}

/// System uptime in clock ticks.
pub fn uptime_ticks(clk_tck: u64) -> Result<u64, HookError> {
    let parse = || -> Option<u64> {
        let s = sys::proc::system("uptime").ok()?;
        let secs = s.split_whitespace().next()?;
        let (whole, frac) = secs.split_once('.').unwrap_or((secs, "0"));
        let hundredths: u64 = format!("{frac:0<2}")[..2].parse().ok()?;
        Some(whole.parse::<u64>().ok()? * clk_tck + hundredths * clk_tck / 100)
    };
    parse().ok_or(HookError::Uptime)
}

/// The pre-resume step of Algorithm 1 for the tree restored under `init`: clear the soft-dirty
/// bits of every process, E = 1 + the latest start time of its threads, wait until the uptime
/// reaches E, then record "E CLK_TCK" in `out` (temp file + rename: present only on success).
pub fn pre_resume(init: i32, out: &Path) -> Result<(), HookError> {
    use std::time::{Duration, Instant};
    let clk =
        nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().ok_or(HookError::ClockTicks)? as u64;
    let tree = restored_tree(init);
    if tree.is_empty() {
        return Err(HookError::NoTree(init));
    }
    for pid in &tree {
        Proc::of(*pid).clear_soft_dirty()?;
    }
    let e = epoch(&tree)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while uptime_ticks(clk)? < e {
        if Instant::now() > deadline {
            return Err(HookError::Deadline(e));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(sys::write_atomic(out, format!("{e} {clk}\n").as_bytes(), 0o644)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &[u8] = include_bytes!("../tests/fixtures/inventory-3.17.img");
    const REAL_NO_UPTIME: &[u8] = include_bytes!("../tests/fixtures/inventory-3.17-no-uptime.img");

    #[test]
    fn reads_the_dump_uptime_crit_encoded() {
        assert_eq!(dump_uptime(REAL).unwrap(), Some(23_270_000));
        assert_eq!(dump_uptime(REAL_NO_UPTIME).unwrap(), None);
    }

    #[test]
    fn rewrite_changes_only_dump_uptime() {
        let new = set_dump_uptime(REAL, 99_990_000).unwrap();
        assert_eq!(dump_uptime(&new).unwrap(), Some(99_990_000));
        // Writing the original value back gives the original bytes.
        assert_eq!(set_dump_uptime(&new, 23_270_000).unwrap(), REAL);
    }

    #[test]
    fn inserts_field_8_before_field_11_when_absent() {
        // crit encoded the same entry with and without dump_uptime: the splice must produce
        // exactly what CRIU's own encoder does.
        assert_eq!(set_dump_uptime(REAL_NO_UPTIME, 23_270_000).unwrap(), REAL);
    }

    #[test]
    fn keeps_fields_it_does_not_know_from_criu_4() {
        // plugins_entry (12, bytes), dump_criu_run_id (13, bytes), allow_uprobes (14, varint).
        let mut body = vec![0x08, 0x02, 0x40, 0x01, 0x58, 0x00];
        body.extend_from_slice(&[0x62, 0x03, 0x0a, 0x01, 0x41]);
        body.extend_from_slice(&[0x6a, 0x04, b'r', b'u', b'n', b'1']);
        body.extend_from_slice(&[0x70, 0x01]);
        let mut img = INVENTORY_MAGIC.to_le_bytes().to_vec();
        img.extend_from_slice(&(body.len() as u32).to_le_bytes());
        img.extend_from_slice(&body);
        let new = set_dump_uptime(&img, 300).unwrap();
        // Field 8 goes back in order, before network_lock_method (11).
        let mut want = vec![0x08, 0x02, 0x40, 0xac, 0x02, 0x58, 0x00];
        want.extend_from_slice(&body[6..]);
        assert_eq!(&new[8..], &want[..]);
        assert_eq!(dump_uptime(&new).unwrap(), Some(300));
    }

    #[test]
    fn rejects_what_is_not_an_inventory() {
        assert_eq!(set_dump_uptime(&[0; 4], 1), Err(ImageError::Short));
        let mut bad = REAL.to_vec();
        bad[0] = 0;
        assert!(matches!(set_dump_uptime(&bad, 1), Err(ImageError::Magic(_))));
        let truncated = &REAL[..REAL.len() - 1];
        assert!(matches!(set_dump_uptime(truncated, 1), Err(ImageError::Length { .. })));
    }

    #[test]
    fn reads_pages_from_a_stats_image() {
        // StatsEntry { dump: { freezing_time 1: 5, pages_scanned 5: 300, pages_skipped_parent 6: 290,
        // pages_written 7: 10 } }, framed as CRIU frames it.
        let dump = [0x08, 0x05, 0x28, 0xac, 0x02, 0x30, 0xa2, 0x02, 0x38, 0x0a];
        let mut entry = vec![0x0a, dump.len() as u8];
        entry.extend_from_slice(&dump);
        let mut img = SERVICE_MAGIC.to_le_bytes().to_vec();
        img.extend_from_slice(&0x5709_3306u32.to_le_bytes());
        img.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        img.extend_from_slice(&entry);
        let s = dump_stats(&img).unwrap();
        assert_eq!(s, DumpStats { pages_scanned: 300, pages_skipped_parent: 290, pages_written: 10 });
        assert!(dump_stats(&img[..12]).is_err());
    }

    #[test]
    fn microseconds_not_ticks() {
        assert_eq!(ticks_to_usec(2327, 100), 23_270_000);
    }

    #[test]
    fn rewrite_in_place_is_atomic_and_exact() {
        let scratch = tempfile::tempdir().unwrap();
        let p = scratch.path().join("inv.img");
        std::fs::write(&p, REAL).unwrap();
        rewrite_dump_uptime(&p, 5_000_000).unwrap();
        assert_eq!(dump_uptime(&std::fs::read(&p).unwrap()).unwrap(), Some(5_000_000));
    }

    #[test]
    fn tree_and_epoch_of_this_process() {
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let tree = restored_tree(me);
        assert!(tree.contains(&me) && tree.contains(&(child.id() as i32)), "{tree:?}");
        let e = epoch(&tree).unwrap();
        let (_, child_start) = Proc::of(child.id() as i32).state_and_start().unwrap();
        assert!(e > child_start, "E must be after the latest start time");
        let clk = 100;
        assert!(uptime_ticks(clk).unwrap() + 1 >= e - 1);
        child.kill().unwrap();
        let _ = child.wait();
    }
}
