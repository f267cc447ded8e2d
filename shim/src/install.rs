//! `planarian install`: put the binary where Podman can find it and register it as a runtime.

use clap::Parser;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

const DROPIN_TEMPLATE: &str = include_str!("../../containers-conf/containers.conf.d/planarian.conf");
const DEFAULT_CONFIG: &str = include_str!("../../containers-conf/planarian.conf");

#[derive(Parser, Debug)]
#[command(name = "planarian install", about = "Install planarian and register it with Podman")]
struct Args {
    /// Installation prefix: the binary goes to PREFIX/bin/planarian.
    #[arg(long, default_value = "/usr/local")]
    prefix: PathBuf,
    /// Where containers.conf drop-ins live.
    #[arg(long, default_value = "/etc/containers/containers.conf.d")]
    containers_conf_dir: PathBuf,
    /// Where planarian's own configuration lives (an existing planarian.conf is kept).
    #[arg(long, default_value = "/etc/planarian")]
    config_dir: PathBuf,
    /// Also make planarian Podman's default runtime.
    #[arg(long)]
    default_runtime: bool,
}

pub fn main(args: &[OsString]) -> Result<i32, crate::Failure> {
    let args: Args = match crate::cli::parse_verb("install", args) {
        Ok(a) => a,
        Err(code) => return Ok(code),
    };
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the running binary: {e}"))?;
    let bin = args.prefix.join("bin/planarian");
    install_file(&exe, &bin)?;
    println!("installed {}", bin.display());
    // The pre-resume hook CRIU runs on restore goes beside it (where the shim looks for it).
    let hooks_src = exe.with_file_name("planarian-criu-hooks");
    let hooks = args.prefix.join("bin/planarian-criu-hooks");
    if hooks_src.exists() {
        install_file(&hooks_src, &hooks)?;
        println!("installed {}", hooks.display());
    } else {
        println!(
            "warning: {} not found: restores will work, but the dump after each one will be full",
            hooks_src.display()
        );
    }
    // The MCP state-proxy sidecar and its remote-state hook, beside it too.
    let proxy_src = exe.with_file_name("planarian-mcp-proxy");
    if proxy_src.exists() {
        let proxy = args.prefix.join("bin/planarian-mcp-proxy");
        install_file(&proxy_src, &proxy)?;
        println!("installed {}", proxy.display());
    }

    let dropin = args.containers_conf_dir.join("planarian.conf");
    sys::write_atomic(&dropin, render_dropin(&bin, args.default_runtime).as_bytes(), 0o644)?;
    println!("registered the runtime in {}", dropin.display());

    let conf = args.config_dir.join("planarian.conf");
    if conf.exists() {
        println!("kept {}", conf.display());
    } else {
        sys::write_atomic(&conf, DEFAULT_CONFIG.as_bytes(), 0o644)?;
        println!("wrote {}", conf.display());
    }
    Ok(0)
}

fn render_dropin(bin: &Path, default_runtime: bool) -> String {
    let default = if default_runtime { "runtime = \"planarian\"\n" } else { "" };
    DROPIN_TEMPLATE.replace("@PLANARIAN@", &bin.display().to_string()).replace("@DEFAULT_RUNTIME@\n", default)
}

/// Copies the binary unless source and destination are the same file.
fn install_file(src: &Path, dst: &Path) -> Result<(), sys::IoError> {
    if let (Ok(a), Ok(b)) = (std::fs::canonicalize(src), std::fs::canonicalize(dst)) {
        if a == b {
            return Ok(());
        }
    }
    let data = std::fs::read(src).map_err(|e| sys::IoError::new("read", src, e))?;
    sys::write_atomic(dst, &data, 0o755)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropin_registers_the_installed_path() {
        let text = render_dropin(Path::new("/opt/pl/bin/planarian"), false);
        let t: toml::Table = text.parse().unwrap();
        assert_eq!(t["engine"]["runtimes"]["planarian"][0].as_str(), Some("/opt/pl/bin/planarian"));
        let json = t["engine"]["runtime_supports_json"].as_array().unwrap();
        assert!(json.iter().any(|v| v.as_str() == Some("planarian")));
        // Podman's own defaults are kept (a drop-in array replaces them in Podman 4).
        assert!(json.iter().any(|v| v.as_str() == Some("crun")));
        assert!(t["engine"].get("runtime").is_none());
    }

    #[test]
    fn dropin_can_make_planarian_the_default() {
        let t: toml::Table = render_dropin(Path::new("/usr/local/bin/planarian"), true).parse().unwrap();
        assert_eq!(t["engine"]["runtime"].as_str(), Some("planarian"));
    }

    #[test]
    fn install_writes_binary_dropin_and_keeps_existing_config() {
        let scratch = tempfile::tempdir().unwrap();
        let dir = scratch.path().join("install-test");
        std::fs::create_dir_all(dir.join("etc/planarian")).unwrap();
        std::fs::write(dir.join("etc/planarian/planarian.conf"), "[store]\nretention = 1\n").unwrap();
        let a = |s: &str| OsString::from(s);
        let code = main(&[
            a("--prefix"),
            dir.join("usr").into(),
            a("--containers-conf-dir"),
            dir.join("etc/containers/containers.conf.d").into(),
            a("--config-dir"),
            dir.join("etc/planarian").into(),
        ])
        .unwrap();
        assert_eq!(code, 0);
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(dir.join("usr/bin/planarian")).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o755);
        let dropin = std::fs::read_to_string(dir.join("etc/containers/containers.conf.d/planarian.conf")).unwrap();
        assert!(dropin.contains(&format!("planarian = [\"{}\"]", dir.join("usr/bin/planarian").display())));
        assert_eq!(
            std::fs::read_to_string(dir.join("etc/planarian/planarian.conf")).unwrap(),
            "[store]\nretention = 1\n"
        );
    }
}
