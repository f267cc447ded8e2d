//! Overlay layers applied onto a plain tree (a ZFS dataset): whiteouts delete, opaque
//! directories replace, everything else is copied over.

use crate::local::Result;
use std::path::{Path, PathBuf};
use sys::proc::Mount;
use sys::Context;

pub struct Layers {
    /// Top first, as overlay lists them.
    pub lower: Vec<PathBuf>,
    pub upper: PathBuf,
}

/// The layers of the overlay mounted at `root`.
pub fn overlay_layers(mounts: &[Mount], root: &Path) -> Option<Layers> {
    let want = root.to_str()?;
    mounts.iter().rev().filter(|m| m.point == want && m.fstype == "overlay").find_map(|m| {
        let get = |k: &str| m.super_option(k);
        let upper = PathBuf::from(get("upperdir")?);
        // Podman gives relative lower paths (l/SHORT) when the option string would be too long:
        // they are relative to the overlay driver's directory, two levels above the upper one.
        let home = upper.parent()?.parent()?.to_path_buf();
        let lower = get("lowerdir")?
            .split(':')
            .map(|p| if p.starts_with('/') { PathBuf::from(p) } else { home.join(p) })
            .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
            .collect();
        Some(Layers { lower, upper })
    })
}

fn is_whiteout(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    md.file_type().is_char_device() && md.rdev() == 0
}

fn is_opaque(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return false };
    let mut buf = [0u8; 4];
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let n = unsafe {
        nix::libc::lgetxattr(c.as_ptr(), c"trusted.overlay.opaque".as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    };
    n == 1 && buf[0] == b'y'
}

fn remove_any(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(md) if md.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// Applies an overlay layer onto a plain tree: whiteouts delete, opaque directories replace,
/// everything else is copied over (owners, modes, times, links kept).
pub fn apply_layer(layer: &Path, dest: &Path) -> Result<()> {
    fn before(layer: &Path, dest: &Path) -> std::io::Result<()> {
        for e in std::fs::read_dir(layer)? {
            let e = e?;
            let md = e.metadata()?;
            let to = dest.join(e.file_name());
            let there = std::fs::symlink_metadata(&to).ok();
            if is_whiteout(&md) || (md.is_dir() && is_opaque(&e.path())) {
                remove_any(&to);
            } else if md.is_dir() {
                if there.as_ref().is_some_and(|t| !t.is_dir()) {
                    remove_any(&to);
                } else if there.is_some() {
                    before(&e.path(), &to)?;
                }
            } else if there.as_ref().is_some_and(|t| t.is_dir()) {
                remove_any(&to);
            }
        }
        Ok(())
    }
    fn after(layer: &Path, dest: &Path) -> std::io::Result<()> {
        for e in std::fs::read_dir(layer)? {
            let e = e?;
            let md = e.metadata()?;
            if is_whiteout(&md) {
                remove_any(&dest.join(e.file_name()));
            } else if md.is_dir() {
                after(&e.path(), &dest.join(e.file_name()))?;
            }
        }
        Ok(())
    }
    before(layer, dest).at("apply", layer)?;
    crate::local::copy::cp(&[], layer, dest)?;
    Ok(after(layer, dest).at("apply", layer)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_layers_resolve_relative_lower_paths() {
        let mi = "60 29 0:45 / /s/overlay/abc/merged rw - overlay overlay rw,lowerdir=l/AAA:l/BBB,upperdir=/s/overlay/abc/diff,workdir=/s/overlay/abc/work\n";
        let ms = sys::proc::parse_mountinfo(mi);
        let l = overlay_layers(&ms, Path::new("/s/overlay/abc/merged")).unwrap();
        assert_eq!(l.upper, Path::new("/s/overlay/abc/diff"));
        assert_eq!(l.lower, vec![PathBuf::from("/s/overlay/l/AAA"), PathBuf::from("/s/overlay/l/BBB")]);
        assert!(overlay_layers(&ms, Path::new("/other")).is_none());
    }

    #[test]
    fn layers_apply_with_whiteouts_and_opaque_directories() {
        let scratch = tempfile::tempdir().unwrap();
        let base = scratch.path().join("layer");
        let (lower, dest) = (base.join("lower"), base.join("dest"));
        std::fs::create_dir_all(lower.join("etc/old")).unwrap();
        std::fs::write(lower.join("etc/passwd"), "root").unwrap();
        std::fs::write(lower.join("etc/old/x"), "x").unwrap();
        std::fs::write(lower.join("gone"), "g").unwrap();
        std::fs::create_dir_all(&dest).unwrap();
        apply_layer(&lower, &dest).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("etc/passwd")).unwrap(), "root");

        // An upper layer: a modified file, a new one, and (when we may make device nodes) a
        // whiteout deleting a file of the lower layer.
        let upper = base.join("upper");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/passwd"), "root\nagent").unwrap();
        std::fs::write(upper.join("new"), "n").unwrap();
        let whiteout = nix::sys::stat::mknod(
            &upper.join("gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .is_ok();
        apply_layer(&upper, &dest).unwrap();
        assert_eq!(std::fs::read_to_string(dest.join("etc/passwd")).unwrap(), "root\nagent");
        assert_eq!(std::fs::read_to_string(dest.join("new")).unwrap(), "n");
        assert!(dest.join("etc/old/x").exists());
        if whiteout {
            assert!(
                std::fs::symlink_metadata(dest.join("gone")).is_err(),
                "the whiteout deleted the file and left no device"
            );
        }
    }
}
